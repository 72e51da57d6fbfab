"""The gateway tests use the session's deployment and gateways (tests/conftest.py: `deployment`,
`start_gateway`, `gateway_url`): real gateway processes on loopback, each a client of the same router. `oai`
is the official `openai` client on the default gateway, `model` the name it serves."""
from __future__ import annotations

import openai
import pytest


@pytest.fixture(scope="module")
def oai(gateway_url):
    with openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="unused", max_retries=0, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def model(oai):
    return oai.models.list().data[0].id
