"""prefill_layout: the ragged layout of a step's prompt chunks, against a per-key construction (CPU)."""
from __future__ import annotations

import random

import numpy as np
import torch

from mii_async.kernels.metadata import device_groups, prefill_layout
from mii_async.workers.execute.runner import host_inputs
from mii_async.workers.core.step_plan import ScheduledSeq, StepPlan


def _expected(tables, qlens, clens, nd, bs, limit):
    """Groups of consecutive chunks by a running key count, each key's slot looked up one by one."""
    groups, cur, keys = [], [], 0
    for s in range(nd, len(qlens)):
        if cur and keys + clens[s] > limit:
            groups.append(cur)
            cur, keys = [], 0
        cur.append(s)
        keys += clens[s]
    groups.append(cur)
    out, row = [], nd
    for g in groups:
        slots = [int(tables[s][p // bs]) * bs + p % bs for s in g for p in range(clens[s])]
        cu_q, cu_k = [0], [0]
        for s in g:
            cu_q.append(cu_q[-1] + qlens[s])
            cu_k.append(cu_k[-1] + clens[s])
        out.append(((row, row + cu_q[-1]), slots, cu_q, cu_k, max(qlens[s] for s in g), max(clens[s] for s in g)))
        row += cu_q[-1]
    return out


def test_layout_matches_per_key_lookup():
    rng = random.Random(0)
    for trial in range(50):
        bs = rng.choice([1, 4, 16])
        nd = rng.randint(0, 4)
        n = nd + rng.randint(1, 6)
        qlens = [1] * nd + [rng.randint(1, 40) for _ in range(n - nd)]
        clens = [rng.randint(1, 300) for _ in range(nd)] + [q + rng.choice([0, 0, rng.randint(1, 200)])
                                                               for q in qlens[nd:]]
        width = max(-(-c // bs) for c in clens)
        tables = np.zeros((n, width), np.int64)
        for i, c in enumerate(clens):
            nb = -(-c // bs)
            tables[i, :nb] = rng.sample(range(1000), nb)
        limit = rng.choice([1, 50, 10_000])
        layout, groups = prefill_layout(tables, qlens, clens, nd, bs, max_group_keys=limit)
        got = [(g.rows, g.kv_slots.tolist(), g.cu_q.tolist(), g.cu_k.tolist(), g.max_q, g.max_k)
               for g in device_groups(torch.from_numpy(layout), groups)]
        assert got == _expected(tables, qlens, clens, nd, bs, limit), trial
        for g in device_groups(torch.from_numpy(layout), groups):
            assert g.cu_q.dtype == g.cu_k.dtype == torch.int32


def test_runner_inputs_carry_the_layout():
    """host_inputs with `ragged` appends the layout after the block tables, at offsets that index its buffer."""
    seqs = [ScheduledSeq(0, [5], 9, [3], True), ScheduledSeq(1, [7, 8, 9], 0, [4], True),
            ScheduledSeq(2, [1, 2], 30, [6, 2, 9], False)]
    plan = StepPlan(seqs, num_decodes=1)
    plain = host_inputs(plan, 16)
    h = host_inputs(plan, 16, ragged=True)
    assert plain.groups == [] and (h.buf[:len(plain.buf)] == plain.buf).all()
    (g,) = device_groups(torch.from_numpy(h.buf), h.groups)
    assert g.rows == (1, 6)
    assert g.cu_q.tolist() == [0, 3, 5] and g.cu_k.tolist() == [0, 3, 35]
    assert g.kv_slots.tolist() == [64, 65, 66] + [6 * 16 + p for p in range(16)] + [2 * 16 + p for p in range(16)]
