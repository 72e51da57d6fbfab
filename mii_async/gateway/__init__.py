"""The gateway: a FastAPI app, served by uvicorn, in front of a deployment's router.

    routes      ws.py (/v1/ws) · rest.py (/generate, /mii/{name}) · openai_routes.py (/v1/models,
                /v1/completions, /v1/chat/completions) · responses_routes.py (/v1/responses) ·
                tokenize_routes.py (/tokenize, /detokenize) · ops.py (/health, /metrics) · ui.py (/ and /static)
    plumbing    app.py (create_app) · state.py (what every route shares) · auth.py · host_check.py ·
                http_errors.py · connection_limits.py · ws_limits.py · sse.py · metrics.py · main.py (the
                process: `python -m mii_async.gateway`)

It talks to the router through an AsyncClient, exactly as user code does, so that any number of gateways may
front one deployment. `import mii_async` does not import it.
"""
