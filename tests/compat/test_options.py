"""Keywords of the seed document and of DeepSpeed-MII: taken, mapped onto ours, or refused with an error that
names the keyword and the nearest supported one; an unknown serve() option lists every option; client() of a
bad name or address says what it takes. Nothing here starts a process: each refusal comes first."""
from __future__ import annotations

import asyncio

import pytest

import mii_async
from mii_async import InvalidParameterError
from mii_async.serve_options import MII_REST_PORT, resolve


def test_seed_and_mii_keywords_map_onto_ours():
    """The seed's enable_rest puts REST on `port` and the router on a free port; MII's enable_restful_api keeps
    the router on port_number and REST on restful_api_port (28080 when not given); MII's other names and its
    config dicts map onto ours."""
    seed = resolve({"model_name": "m", "tensor_parallel": 2, "port": 50051, "enable_rest": True})
    assert (seed.model, seed.enable_http, seed.kwargs) == ("m", True, {"tensor_parallel": 2, "port": 0,
                                                                          "http_port": 50051})
    mii = resolve({"model_name_or_path": "m", "deployment_name": "d", "replica_num": 2, "port_number": 50050,
                   "enable_restful_api": True, "max_length": 512})
    assert (mii.model, mii.deployment_name, mii.enable_http) == ("m", "d", True)
    assert mii.kwargs == {"replicas": 2, "port": 50050, "max_model_len": 512, "http_port": MII_REST_PORT}
    nested = resolve({"model": "m", "mii_config": {"deployment_name": "d", "enable_restful_api": True,
                                                   "restful_api_port": 9000},
                      "model_config": {"tensor_parallel": 2, "task": "text-generation"}})
    assert (nested.deployment_name, nested.kwargs) == ("d", {"http_port": 9000, "tensor_parallel": 2})


@pytest.mark.parametrize("kwargs, param, says", [
    ({"no_such_option": 1}, "no_such_option", r"serve\(\) takes: "),
    ({"quantization_mode": "wf6af16"}, "quantization_mode", "nearest supported option is dtype"),
    ({"hostfile": "/etc/hosts"}, "hostfile", "mii-async worker"),
    ({"task": "text-classification"}, "task", "text-generation"),
    ({"replica_num": 2, "replicas": 3}, "replica_num", "give one of them"),
    ({"enable_rest": "yes"}, "enable_rest", "true or false"),
    ({"enable_rest": True, "http_port": 8001}, "enable_rest", "give port, not http_port"),
    ({"enable_terminate": True}, "enable_terminate", "needs the gateway"),
    ({"deployment_name": "no spaces"}, "deployment_name", "letters, digits"),
    ({"mii_config": ["deployment_name"]}, "mii_config", r"dict of serve\(\) keywords"),
])
def test_serve_refuses_what_it_cannot_honour_before_starting(kwargs, param, says):
    with pytest.raises(InvalidParameterError, match=says) as e:
        mii_async.serve("unused-model", **kwargs)
    assert e.value.param == param


def test_unknown_serve_option_lists_every_option():
    """The list names the deployment's, the gateway's and the engine's options, ours and MII's."""
    with pytest.raises(InvalidParameterError) as e:
        mii_async.serve("unused-model", tensor_paralel=2)
    listed = str(e.value).split("serve() takes: ", 1)[1].split(", ")
    for name in ("tensor_parallel", "replicas", "port", "http_port", "api_key", "kv_cache_memory", "max_num_seqs",
                 "deployment_name", "enable_rest", "enable_restful_api", "restful_api_port", "replica_num"):
        assert name in listed, name


@pytest.mark.parametrize("address, says", [
    ("no-such-deployment", "no deployment named 'no-such-deployment'"),
    ("tcp://127.0.0.1", "not HOST:PORT"),
    ("127.0.0.1:70000", "port in 1..65535"),
    ("http://127.0.0.1:8000", "scheme must be tcp://"),
    ("", "must be a router address"),
    (5555, "must be a router address"),
])
def test_client_of_a_bad_name_or_address_says_what_it_takes(address, says):
    with pytest.raises(InvalidParameterError, match=says) as e:
        mii_async.client(address)
    assert e.value.param == "address" and "deployment_name" in str(e.value)


def test_client_takes_host_port_and_tcp_addresses():
    for given in ("127.0.0.1:5555", "tcp://127.0.0.1:5555"):
        c = mii_async.client(given)
        assert c.address == "tcp://127.0.0.1:5555"
        c.close()


@pytest.mark.parametrize("params, param, says", [
    ({"num_beams": 4}, "num_beams", "do_sample=False"),
    ({"no_repeat_ngram_size": 3}, "no_repeat_ngram_size", "repetition_penalty"),
    ({"max_tokens": 8}, "max_tokens", "max_new_tokens"),
    ({"stream": True}, "stream", "streaming_fn"),
    ({"max_length": 1}, "max_length", "at least 2"),
    ({"max_length": "64"}, "max_length", "integer"),
])
def test_generate_refuses_what_it_cannot_honour_before_sending(params, param, says):
    """Refused by the client, naming the nearest supported parameter, before any request is sent (the
    address has no router: a request would wait for one)."""
    client = mii_async.client("tcp://127.0.0.1:9", timeout_s=60)
    try:
        with pytest.raises(InvalidParameterError, match=says) as e:
            client.generate(["hi"], **params)
        assert e.value.param == param

        async def from_a_coroutine():
            await client.generate(["hi"], **params)

        with pytest.raises(InvalidParameterError, match=says):
            asyncio.run(from_a_coroutine())
    finally:
        client.close()


def test_streaming_fn_streams_one_prompt():
    client = mii_async.client("tcp://127.0.0.1:9", timeout_s=60)
    try:
        with pytest.raises(InvalidParameterError, match="one prompt") as e:
            client.generate(["a", "b"], streaming_fn=print)
        assert e.value.param == "streaming_fn"
        with pytest.raises(InvalidParameterError, match="must be a function") as e:
            client.generate(["a"], streaming_fn="print")
    finally:
        client.close()


def test_pipeline_takes_mii_keywords_and_refuses_tensor_parallel():
    with pytest.raises(InvalidParameterError, match="mii_query_handle") as e:
        mii_async.pipeline("unused-model", tensor_parallel=2)
    assert e.value.param == "tensor_parallel"
    with pytest.raises(InvalidParameterError, match="positive integer") as e:
        mii_async.mii_query_handle("unused-model", tensor_parallel=0)
    assert e.value.param == "tensor_parallel"
