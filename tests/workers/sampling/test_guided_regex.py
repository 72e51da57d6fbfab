"""guided_regex is Rust's regex dialect (outlines-core's): syntax only Rust knows is taken where the request is
checked (the client, the router, the gateway) and compiled by the replica; syntax broken in both is refused
at once, naming guided_regex."""
from __future__ import annotations

import pytest

from mii_async.errors import InvalidParameterError
from mii_async.params import SamplingParams

RUST_ONLY = [r"\x{263A}{1,3}", r"(?U)[a-z]+b", r"(?<word>[a-z]+)!", r"\pL{2}"]


@pytest.mark.parametrize("regex", RUST_ONLY)
def test_rust_syntax_is_taken(regex):
    assert SamplingParams(guided_regex=regex).guided_regex == regex


@pytest.mark.parametrize("regex", ["(ab", "[a-", "a{2,1}", "*a"])
def test_broken_syntax_is_refused_naming_the_field(regex):
    with pytest.raises(InvalidParameterError, match="guided_regex"):
        SamplingParams(guided_regex=regex)


def test_the_replica_compiles_rust_syntax(default_model_dir):
    """Each regex above compiles into a token automaton for the default model's vocabulary."""
    from mii_async.workers.sampling.guide_compiler import GuideCompiler

    compiler = GuideCompiler(default_model_dir, [2])
    try:
        for regex in RUST_ONLY:
            index, _ = compiler.index(("guided_regex", regex)).result(timeout=120)
            assert index is not None, regex
    finally:
        compiler.close()
