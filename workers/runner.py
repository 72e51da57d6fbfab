"""Runner: StepPlan → input tensors → forward → logits of the sampled rows. Makes no scheduling decision."""
from __future__ import annotations

import torch

from mii_async.kernels.metadata import AttentionMetadata

from .models.llama import LlamaModel
from .step_plan import StepPlan


class Runner:
    def __init__(self, model: LlamaModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
                 device: torch.device) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.graphs = None            # DecodeGraphs, once captured (a GPU replica with cuda_graphs)

    def execute(self, plan: StepPlan) -> torch.Tensor:
        """Runs one step; returns logits [number of sampled seqs, V] in plan order."""
        if self.graphs is not None:
            logits = self.graphs.run(plan)
            if logits is not None:
                return logits
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        qlens: list[int] = []
        clens: list[int] = []
        sample_rows: list[int] = []
        for s in plan.seqs:
            n = len(s.token_ids)
            ids += s.token_ids
            p = range(s.start_pos, s.start_pos + n)
            pos += p
            slots += [s.block_table[i // bs] * bs + i % bs for i in p]
            qlens.append(n)
            clens.append(s.start_pos + n)
            if s.sample:
                sample_rows.append(len(ids) - 1)
        width = max(len(s.block_table) for s in plan.seqs)
        tables = [s.block_table + [0] * (width - len(s.block_table)) for s in plan.seqs]
        dev = self.device

        def t(x: list) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.int64, device=dev)

        qsl = [0]
        for n in qlens:
            qsl.append(qsl[-1] + n)
        meta = AttentionMetadata(slot_mapping=t(slots), block_tables=t(tables), context_lens=t(clens),
                                 query_start_loc=t(qsl), num_decodes=plan.num_decodes,
                                 max_context_len=max(clens), query_lens=qlens, context_lens_host=clens)
        return self.model.forward(t(ids), t(pos), self.kv_caches, meta, t(sample_rows))
