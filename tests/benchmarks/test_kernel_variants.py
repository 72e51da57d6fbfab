"""A probe's decode-attention variant is a KernelConfig of its own: built from the engine's by width and grid
order, and put on the engine's model (and runner) and taken off again without touching any module state."""
from __future__ import annotations

from benchmarks.kernel_variants import capture_variant, recapture, use_variant, variant_config
from mii_async.kernels import decode_attention
from mii_async.kernels.config import DEFAULT, KernelConfig
from mii_async.params import SamplingParams


def test_a_variant_sets_the_width_and_grid_asked_and_keeps_the_rest():
    base = KernelConfig(decode_kernel="stream", mma_narrow_from=128, pdl=False)
    assert variant_config(base, None, None) == base
    assert variant_config(base, 2, None) == KernelConfig(decode_kernel="stream", mma_narrow_from=0, pdl=False)
    assert variant_config(base, 4, "sequences") == KernelConfig(decode_kernel="stream", decode_grid="sequences",
                                                                pdl=False)


def test_an_engine_steps_with_a_variants_op_set_and_gets_its_own_back(tiny_model):
    """On the CPU (reference ops, no graphs) the tokens are the same whatever the config: the variant's op set
    is the model's while it is on, the engine's own afterwards, and the kernel modules hold no config."""
    from tests.workers.helpers import make_engine

    engine = make_engine(tiny_model("llama"), num_blocks=64)
    module_state = {k: v for k, v in vars(decode_attention).items() if not k.startswith("_")}
    try:
        own = engine.model.ops
        assert own.config == DEFAULT and engine.runner.graphs is None
        variant = capture_variant(engine, variant_config(own.config, 2, "sequences"))
        assert variant.graphs is None and variant.ops.config == KernelConfig(mma_narrow_from=0,
                                                                             decode_grid="sequences")
        assert capture_variant(engine, own.config).ops is own

        def tokens() -> list[int]:
            engine.add_request(engine.num_steps + 1, [5, 9, 13, 21], SamplingParams(max_new_tokens=6,
                                                                                     ignore_eos=True))
            out = []
            while engine.has_work():
                out += [o.token_id for o in engine.step()]
            return out

        first = tokens()
        before = use_variant(engine, variant)
        assert before.ops is own and engine.model.ops is variant.ops
        assert tokens() == first
        use_variant(engine, before)
        assert engine.model.ops is own
        recapture(engine, KernelConfig(decode_grid="sequences"))
        assert engine.model.ops.config.decode_grid == "sequences" and engine.runner.graphs is None
        assert tokens() == first
        assert {k: v for k, v in vars(decode_attention).items() if not k.startswith("_")} == module_state
    finally:
        engine.close()
