"""get_ops binds a KernelConfig to a backend's ops: the configured ops get it as `config=`, every other name
is the backend's own, and the CUDA ops that take a config keep the reference's signatures otherwise."""
from __future__ import annotations

import inspect
import types

import pytest

from mii_async.kernels import cuda, get_ops, reference
from mii_async.kernels.config import DEFAULT, KernelConfig
from mii_async.kernels.op_set import OpSet


def _backend() -> types.ModuleType:
    """A backend module whose one configured op returns the config it was called with."""
    m = types.ModuleType("backend_under_test")
    m.CONFIGURED = ("choice",)
    m.choice = lambda x, *, config=DEFAULT: (x, config)
    m.plain = lambda x: x + 1
    m.FLAG = True
    return m


def test_a_configured_op_gets_the_op_sets_config():
    c = KernelConfig(decode_kernel="split", decode_grid="sequences", mma_narrow_from=64, pdl=False)
    ops = OpSet(_backend(), c)
    assert ops.choice(3) == (3, c)
    assert ops.plain(3) == 4 and ops.FLAG is True and ops.config is c


def test_two_op_sets_of_one_backend_keep_their_own_configs():
    backend = _backend()
    a, b = OpSet(backend, KernelConfig()), OpSet(backend, KernelConfig(decode_grid="sequences"))
    assert a.choice(0)[1].decode_grid == "kv_heads" and b.choice(0)[1].decode_grid == "sequences"
    a.choice = lambda x: "wrapped"                     # a probe wrapping one op set's op
    assert a.choice(0) == "wrapped" and b.choice(0)[1].decode_grid == "sequences"
    assert backend.choice(0) == (0, DEFAULT)


def test_a_missing_name_is_an_attribute_error():
    ops = OpSet(_backend(), DEFAULT)
    with pytest.raises(AttributeError):
        ops.nothing_here
    assert not hasattr(ops, "__wrapped__")


def test_get_ops_binds_the_config_it_is_given():
    c = KernelConfig(decode_kernel="stream")
    ops = get_ops("cuda", c)
    assert ops.backend is cuda and ops.config is c
    assert ops.paged_attention.func is cuda.paged_attention and ops.paged_attention.keywords == {"config": c}
    assert ops.RAGGED_PREFILL is True and ops.decode_supported is cuda.decode_supported
    assert get_ops("cuda").config == DEFAULT
    ref = get_ops("reference", c)
    assert ref.backend is reference and ref.paged_attention is reference.paged_attention
    with pytest.raises(ValueError, match="unknown kernel backend 'tpu'"):
        get_ops("tpu")


@pytest.mark.parametrize("name", cuda.CONFIGURED)
def test_each_configured_cuda_op_takes_the_config_by_keyword_beside_the_references_parameters(name):
    params = inspect.signature(getattr(cuda, name)).parameters
    assert params["config"].kind is inspect.Parameter.KEYWORD_ONLY and params["config"].default is DEFAULT
    ref = getattr(reference, name, None)
    if ref is not None:                                # paged_attention_decode is the CUDA backend's own
        ours = [p for p in params if p != "config"]
        assert ours == list(inspect.signature(ref).parameters), name
