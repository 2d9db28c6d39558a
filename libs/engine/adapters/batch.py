"""A step's adapters: which expert entries each sequence applies, in the form the kernels read.

For every projection a CSR list: sequence b's entries are [entry_ptr[b], entry_ptr[b+1]), each a
pool position (LoRA: first row of an 8-row page and its row count; IA³: a table slot) with the
request's weight. Soft prompts become (token, pool row) pairs for the positions that hold virtual
tokens. Built once per step by the runner; the model calls `apply_output`, `scale_input` and
`embed` at each projection.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from libs.engine.adapters.device import PAGE_ROWS, DeviceAdapters, ia3_key
from libs.engine.kernels import TorchOps
from libs.engine.sequence import Sequence


@dataclass
class Entries:
    """One projection's entries for the step, as CSR over the step's sequences."""

    entry_ptr: torch.Tensor  # [B + 1] int32
    index: torch.Tensor  # [E] int32: LoRA first row, or IA³ slot
    count: torch.Tensor  # [E] int32: LoRA rows (0 for IA³)
    scale: torch.Tensor  # [E] float32: the request's weight
    per_seq: list[list[tuple[int, int, float]]]  # the same, as Python lists (torch reference path)


def _entries(per_seq: list[list[tuple[int, int, float]]], device: torch.device) -> Entries:
    counts = [len(e) for e in per_seq]
    ptr = np.zeros(len(per_seq) + 1, dtype=np.int32)
    np.cumsum(counts, out=ptr[1:])
    flat = [entry for seq in per_seq for entry in seq]

    def column(i: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([e[i] for e in flat], dtype=dtype, device=device)

    return Entries(
        torch.from_numpy(ptr).to(device),
        column(0, torch.int32),
        column(1, torch.int32),
        column(2, torch.float32),
        per_seq,
    )


@dataclass
class AdapterBatch:
    query_start_loc: torch.Tensor  # [B + 1] int32, as in the step's attention metadata
    token_ranges: list[tuple[int, int]]
    lora: dict[str, Entries]  # projection -> entries
    ia3: dict[str, Entries]  # ia3_key -> entries
    pools: DeviceAdapters
    virtual_tokens: torch.Tensor | None = None  # [V] flat token indices holding virtual tokens
    virtual_rows: torch.Tensor | None = None  # [V] their rows in the soft-prompt pool

    def embed(self, embeddings: torch.Tensor) -> torch.Tensor:
        """Put the soft prompts' rows in place of the virtual tokens' embeddings."""
        if self.virtual_tokens is not None:
            embeddings[self.virtual_tokens] = self.pools.soft.tensors[0][self.virtual_rows].to(
                embeddings.dtype
            )
        return embeddings

    def scale_input(self, ops: TorchOps, layer: int, projection: str, x: torch.Tensor) -> torch.Tensor:
        """IA³ input scaling (PEFT feedforward modules), in place on the projection's input."""
        entries = self.ia3.get(ia3_key(projection, True))
        if entries is not None:
            table = self.pools.ia3_tables[ia3_key(projection, True)][layer]
            ops.ia3_scale(x, 0, table, self.query_start_loc, self.token_ranges, entries)
        return x

    def apply_output(
        self,
        ops: TorchOps,
        layer: int,
        projections: tuple[str, ...],
        offsets: tuple[int, ...],
        y: torch.Tensor,
        x: torch.Tensor,
    ) -> None:
        """IA³ output scaling, then LoRA deltas, for each projection fused into `y` at its column offset."""
        for projection, offset in zip(projections, offsets, strict=True):
            entries = self.ia3.get(ia3_key(projection, False))
            if entries is not None:
                table = self.pools.ia3_tables[ia3_key(projection, False)][layer]
                ops.ia3_scale(y, offset, table, self.query_start_loc, self.token_ranges, entries)
            entries = self.lora.get(projection)
            if entries is not None:
                a, bt = self.pools.lora[projection].tensors
                ops.lora_apply(
                    y, x, a[layer], bt[layer], offset, self.query_start_loc, self.token_ranges, entries
                )


def build_adapter_batch(
    scheduled: list[tuple[Sequence, int]],
    qsl: np.ndarray,
    query_start_loc: torch.Tensor,
    pools: DeviceAdapters,
    device: torch.device,
) -> AdapterBatch | None:
    """The step's adapter entries, or None when no scheduled sequence uses an expert."""
    if not any(seq.experts for seq, _ in scheduled):
        return None
    rows = len(qsl) - 1  # includes padding rows, which have no entries
    lora: dict[str, list[list[tuple[int, int, float]]]] = {}
    ia3: dict[str, list[list[tuple[int, int, float]]]] = {}
    virtual_tokens: list[int] = []
    virtual_rows: list[int] = []
    for b, (seq, num_new) in enumerate(scheduled):
        soft_rows: list[int] = []
        for use in seq.experts:
            residency = pools.residency(use.expert)
            weights = use.expert.weights
            if weights.lora is not None:
                for projection, pages in residency.lora_pages.items():
                    seq_entries = lora.setdefault(projection, [[] for _ in range(rows)])[b]
                    for i, page in enumerate(pages):
                        count = min(PAGE_ROWS, weights.lora.rank - i * PAGE_ROWS)
                        seq_entries.append((page * PAGE_ROWS, count, use.weight))
            elif weights.ia3 is not None:
                for projection, on_input in weights.ia3.scales_input.items():
                    key = ia3_key(projection, on_input)
                    ia3.setdefault(key, [[] for _ in range(rows)])[b].append(
                        (residency.ia3_slot, 0, use.weight)
                    )
            else:
                soft_rows += residency.soft_rows
        start = seq.num_computed_tokens
        for position in range(start, min(start + num_new, len(soft_rows))):
            virtual_tokens.append(int(qsl[b]) + position - start)
            virtual_rows.append(soft_rows[position])
    batch = AdapterBatch(
        query_start_loc=query_start_loc,
        token_ranges=[(int(qsl[b]), int(qsl[b + 1])) for b in range(rows)],
        lora={p: _entries(e, device) for p, e in lora.items()},
        ia3={k: _entries(e, device) for k, e in ia3.items()},
        pools=pools,
    )
    if virtual_tokens:
        batch.virtual_tokens = torch.tensor(virtual_tokens, dtype=torch.int64, device=device)
        batch.virtual_rows = torch.tensor(virtual_rows, dtype=torch.int64, device=device)
    return batch
