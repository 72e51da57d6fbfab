"""From a checkout's root, `import kernels` is the Hub's `kernels` distribution (transformers imports it), not
this repository's kernels/ directory, which is mii_async.kernels."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str, extra_path: Path | None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), str(extra_path or "")) if p)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)


def test_the_distribution_takes_the_name(tmp_path):
    pkg = tmp_path / "kernels"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("WHO = 'hub'\n")
    r = _run("import kernels, mii_async.kernels as ours; from kernels import WHO; "
             "print(WHO, kernels.__file__ != ours.__file__, ours.get_ops('reference').backend.__name__)", tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["hub", "True", "mii_async.kernels.reference"]


def test_without_the_distribution_the_checkout_keeps_the_name():
    """With no `kernels` found past the checkout (site-packages hidden here), `import kernels` is this
    directory, without a `__version__`: transformers' version check then reports no usable kernels."""
    r = _run("import sys; sys.path[:] = [p for p in sys.path if 'packages' not in p]; import kernels; "
             "print(kernels.__name__, hasattr(kernels, '__version__'), *kernels.BACKENDS)", None)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["kernels", "False", "reference", "cuda", "cpu"]


def test_transformers_finds_no_usable_kernels_without_the_distribution():
    import importlib.metadata

    import pytest

    try:
        importlib.metadata.distribution("kernels")
        pytest.skip("the kernels distribution is installed here")
    except importlib.metadata.PackageNotFoundError:
        pass
    r = _run("from transformers.utils.import_utils import is_kernels_available; import transformers.activations; "
             "print(is_kernels_available())", None)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[-1] == "False"
