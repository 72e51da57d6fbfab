"""The README's Python snippets run as written, as plain scripts against real processes: the quick start
(the in-process pipeline), serving (a router and two worker processes) and the `openai` package against the
gateway (its address the only change: the test's gateway listens on a free port, not 8000)."""
from __future__ import annotations

import re

import pytest

from tests.compat.scripts import REPO, failed, run_script, write_script

pytestmark = pytest.mark.slow


def _snippet(marker: str) -> str:
    """The README's ```python block that contains `marker`."""
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S)
    found = [b for b in blocks if marker in b]
    assert len(found) == 1, f"the README has {len(found)} python blocks with {marker!r}"
    return found[0]


def test_quick_start(tmp_path, default_model_dir):
    """The pipeline answers (the chat line says Paris), streams, and closes."""
    proc = run_script(write_script(tmp_path, "quick_start.py", _snippet("mii_async.pipeline()")))
    assert proc.returncode == 0, failed(proc)
    assert "Paris" in proc.stdout, proc.stdout


def test_serving(tmp_path, default_model_dir):
    """serve(replicas=2) streams, generates, reports health and terminates, awaited in asyncio.run(main())."""
    proc = run_script(write_script(tmp_path, "serving.py", _snippet("mii_async.serve(replicas=2)")))
    assert proc.returncode == 0, failed(proc)
    assert "'state': 'ready'" in proc.stdout, proc.stdout


def test_openai_package(tmp_path, start_gateway):
    """Against a gateway that serves the default model under its name, as `mii-async serve` does."""
    pytest.importorskip("openai")
    from mii_async.model_source import DEFAULT_MODEL_NAME

    source = _snippet("from openai import OpenAI")
    assert "http://127.0.0.1:8000/v1" in source and f'model="{DEFAULT_MODEL_NAME}"' in source
    url = start_gateway(served_model_name=DEFAULT_MODEL_NAME).url
    proc = run_script(write_script(tmp_path, "openai_client.py", source.replace("http://127.0.0.1:8000", url)))
    assert proc.returncode == 0, failed(proc)
    assert "Paris" in proc.stdout, proc.stdout
