"""The gateway tests use the session's deployment and gateways (tests/conftest.py: `deployment`,
`start_gateway`, `gateway_url`): real gateway processes on loopback, each a client of the same router."""
