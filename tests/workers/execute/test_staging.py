"""The runner's pinned staging buffers (on the device; skipped without CUDA)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu


def test_uploads_in_turn_grow_and_keep_every_copy():
    """Buffers of many sizes, some past a slot's size, uploaded back to back with no sync between them: every
    device copy holds its own buffer (a slot is not rewritten before its copy has run), and a slot that grows
    grows once."""
    from mii_async.workers.execute.staging import Staging

    st = Staging(torch.device("cuda"), slots=3, words=1024)
    rng = np.random.default_rng(0)
    sizes = [1, 1024, 1025, 7, 5000, 1024, 3, 5000, 9000, 2]
    bufs = [rng.integers(-2**62, 2**62, n, dtype=np.int64) for n in sizes]
    block = torch.cuda._sleep if hasattr(torch.cuda, "_sleep") else None
    outs = []
    for b in bufs:
        if block is not None:
            block(1_000_000)                   # the device busy: the copies queue behind it
        outs.append(st.upload(b))
    for b, o in zip(bufs, outs):
        assert o.device.type == "cuda" and o.dtype == torch.int64
        assert np.array_equal(o.cpu().numpy(), b)
    # slot 2 grows for 1025 (to 2048) and for 9000, slot 1 for 5000 (reused by the second 5000)
    assert st.grown == 3
    assert [h.numel() for h in st.hosts] == [1024, 5000, 9000]
    assert all(h.is_pinned() for h in st.hosts)


def test_runner_uploads_through_staging():
    from mii_async.workers.execute.runner import Runner
    from mii_async.workers.execute.staging import Staging

    r = Runner.__new__(Runner)
    r.staging = Staging(torch.device("cuda"))
    b = np.arange(100, dtype=np.int64)
    assert np.array_equal(r.upload(b).cpu().numpy(), b)
