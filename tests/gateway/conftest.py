"""Gateways in front of the session's real deployment (tests/conftest.py `deployment`): real gateway processes
on loopback, each a client of the same router."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def start_gateway(deployment):
    """Starts a gateway process with the given HttpConfig fields (port: any free one); stops them all at the end."""
    from mii_async.config import HttpConfig
    from mii_async.deployment import GatewayProcess
    from tests.mesh_helpers import wait_gone

    started = []

    def start(**http):
        gw = GatewayProcess(deployment.address, HttpConfig(**{"http_port": 0, **http}))
        started.append(gw)
        return gw

    yield start
    for gw in started:
        gw.stop()
    assert not wait_gone([gw.pid for gw in started]), "gateway processes left behind"


@pytest.fixture(scope="session")
def gateway_url(start_gateway) -> str:
    """The base URL (http://127.0.0.1:PORT) of a gateway with the default settings and no API key."""
    return start_gateway().url
