"""ServedDeployment: the processes one `serve()` call started — its router, its gateway when asked — and the
deployment's registry entry, kept together for the client that serve() returns.

The deployment may be stopped by any client (`terminate_server()` of one that found it by name) or by the
gateway's `GET /terminate`, not only by the client serve() returned. A watcher thread therefore waits for the
router to exit, whoever stopped it, and then stops the gateway (which would otherwise answer 503 until this
process exits) and removes the registry entry. The stops of the processes are serialised by one lock: the
owner's `terminate_server()` and the watcher may reach them at once.
"""
from __future__ import annotations

import logging
import threading

from . import deployment_registry as registry
from .deployment import GatewayProcess, RouterProcess

log = logging.getLogger("mii_async.served_deployment")


class ServedDeployment:
    """Stands where AsyncClient keeps the RouterProcess it started (`_process`): the router's pid, child,
    address, wait and stop; `gateway` stands for its GatewayProcess (url, pid, stop)."""

    def __init__(self, router: RouterProcess, gateway: GatewayProcess | None, *, name: str | None,
                 model: str | None, terminate_route: bool) -> None:
        self.router = router
        self.pid, self.child, self.address = router.pid, router.child, router.address
        self.status, self.curve_dir = router.status, router.curve_dir
        self._gateway = gateway
        self.gateway = _GatewayView(self, gateway) if gateway is not None else None
        self._lock = threading.Lock()
        self.entry: registry.Entry | None = None
        try:
            self.entry = registry.register(name=name, address=router.address, pid=router.pid, model=model,
                                           http_url=gateway.url if gateway is not None else None,
                                           curve_dir=router.curve_dir, terminate_route=terminate_route)
        except OSError as exc:
            if name is not None or terminate_route:       # what was asked needs the entry
                raise
            # An unnamed deployment serves without it: only client(name) and /terminate read the registry.
            log.warning("this deployment is not in the host's registry (%s): %s", registry.registry_dir(), exc)
        self.watcher = threading.Thread(target=self._watch, name="mii_async-deployment-watch", daemon=True)
        self.watcher.start()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Waits for the router to exit (None: for as long as it runs); True if it did."""
        return self.router.wait(float("inf") if timeout_s is None else timeout_s)

    def stop(self, timeout_s: float = 10.0) -> None:
        with self._lock:
            self.router.stop(timeout_s)

    def stop_gateway(self, timeout_s: float = 10.0) -> None:
        if self._gateway is not None:
            with self._lock:
                self._gateway.stop(timeout_s)

    def _watch(self) -> None:
        self.router.child.proc.wait()
        log.info("the router (pid %d) has exited: %s", self.pid, self.router.child.describe_exit())
        if self.entry is not None:
            registry.unregister(self.entry)
        self.stop_gateway()
        self.stop()                      # its lifeline's end, in this process


class _GatewayView:
    def __init__(self, owner: ServedDeployment, gateway: GatewayProcess) -> None:
        self._owner = owner
        self.url, self.pid, self.child, self.http = gateway.url, gateway.pid, gateway.child, gateway.http

    def stop(self, timeout_s: float = 10.0) -> None:
        self._owner.stop_gateway(timeout_s)
