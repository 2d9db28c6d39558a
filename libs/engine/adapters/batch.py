"""A step's adapters: which expert entries each sequence applies, in the form the kernels read.

For every projection a CSR list: sequence b's entries are [entry_ptr[b], entry_ptr[b+1]), each a
pool position (LoRA: first row of an 8-row page and its row count; IA³: a table slot) with the
request's weight. Soft prompts become (token, pool row) pairs for the positions that hold virtual
tokens.

Two halves: `AdapterPlan` is the host side, built once per step from the scheduled sequences;
it places its arrays in the step's staging layout (`staging.py`) and fills them with numpy.
`AdapterBatch` is the device side over those staged views, which the model calls at each
projection (`apply_output`, `scale_input`, `embed`). The kernels index the pools through the CSR
tensors, so one launch serves every adapter in the batch, and a CUDA graph captured over the views
serves any later step whose entries fit the same capacities.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from libs.engine.adapters.device import PAGE_ROWS, DeviceAdapters, ia3_key
from libs.engine.kernels import Ia3Slice, LoraSlice, TorchOps
from libs.engine.sequence import Sequence
from libs.engine.staging import Layout

PerSeq = list[list[tuple[int, int, float]]]  # per sequence: (pool index, rows, weight)


@dataclass
class Entries:
    """One projection's entries for the step, as CSR over the step's sequences."""

    entry_ptr: torch.Tensor  # [B + 1] int32
    index: torch.Tensor  # [E] int32: LoRA first row, or IA³ slot
    count: torch.Tensor  # [E] int32: LoRA rows (0 for IA³)
    scale: torch.Tensor  # [E] float32: the request's weight
    per_seq: PerSeq  # the same, as Python lists (torch reference path)
    max_query_len: int = 1  # host bounds the batched kernels size their launches by
    max_entries: int = 1


@dataclass
class AdapterPlan:
    """The step's entries on the host: per key, the entries of each row (padding rows have none)."""

    rows: int
    lora: dict[str, PerSeq] = field(default_factory=dict)  # projection -> entries
    ia3: dict[str, PerSeq] = field(default_factory=dict)  # ia3_key -> entries
    virtual_tokens: list[int] = field(default_factory=list)  # flat token indices holding virtual tokens
    virtual_rows: list[int] = field(default_factory=list)  # their rows in the soft-prompt pool

    @property
    def keys(self) -> tuple[tuple[str, str], ...]:
        """Which kernels the step runs: ("lora", projection) and ("ia3", key) pairs, sorted. A CUDA
        graph is captured per key set."""
        return tuple(sorted([("lora", p) for p in self.lora] + [("ia3", k) for k in self.ia3]))

    @property
    def max_entries(self) -> int:
        """The most entries any row has for any key."""
        lists = [*self.lora.values(), *self.ia3.values()]
        return max((len(e) for per_seq in lists for e in per_seq), default=0)

    def entry_counts(self) -> dict[tuple[str, str], int]:
        return {("lora", p): sum(map(len, e)) for p, e in self.lora.items()} | {
            ("ia3", k): sum(map(len, e)) for k, e in self.ia3.items()
        }

    def padded(self, rows: int) -> AdapterPlan:
        """The same entries with empty rows appended up to `rows` (a padded decode step)."""
        extra = rows - self.rows

        def pad(per_key: dict[str, PerSeq]) -> dict[str, PerSeq]:
            return {key: per_seq + [[] for _ in range(extra)] for key, per_seq in per_key.items()}

        return AdapterPlan(rows, pad(self.lora), pad(self.ia3), self.virtual_tokens, self.virtual_rows)

    def add_fields(self, layout: Layout, capacities: dict[tuple[str, str], int]) -> None:
        """Place the CSR arrays of each key (capacity: entries) and the soft-prompt pairs in `layout`."""
        for kind, key in self.keys:
            name, cap = f"{kind}:{key}", max(1, capacities[(kind, key)])
            layout.add(name + ".entry_ptr", torch.int32, self.rows + 1)
            layout.add(name + ".index", torch.int32, cap)
            layout.add(name + ".count", torch.int32, cap)
            layout.add(name + ".scale", torch.float32, cap)
        if self.virtual_tokens:
            layout.add("virtual_tokens", torch.int64, len(self.virtual_tokens))
            layout.add("virtual_rows", torch.int64, len(self.virtual_rows))

    def fill(self, views: dict[str, np.ndarray]) -> None:
        """Write the entries into the staged numpy views of `add_fields`' arrays."""
        for kind, per_key in (("lora", self.lora), ("ia3", self.ia3)):
            for key, per_seq in per_key.items():
                name = f"{kind}:{key}"
                ptr = views[name + ".entry_ptr"]
                ptr[0] = 0
                np.cumsum([len(e) for e in per_seq], out=ptr[1:])
                flat = [entry for seq_entries in per_seq for entry in seq_entries]
                if flat:
                    index, count, weight = zip(*flat, strict=True)
                    views[name + ".index"][: len(flat)] = index
                    views[name + ".count"][: len(flat)] = count
                    views[name + ".scale"][: len(flat)] = weight
        if self.virtual_tokens:
            views["virtual_tokens"][:] = self.virtual_tokens
            views["virtual_rows"][:] = self.virtual_rows

    def batch(
        self,
        views: dict[str, torch.Tensor],
        query_start_loc: torch.Tensor,
        token_ranges: list[tuple[int, int]],
        pools: DeviceAdapters,
        max_query_len: int,
        max_entries: int,
    ) -> AdapterBatch:
        """The device-side batch over the staged views (`max_entries`: the bound the kernels size
        their scratch by, at least `self.max_entries`)."""

        def entries(kind: str, key: str, per_seq: PerSeq) -> Entries:
            name = f"{kind}:{key}"
            return Entries(
                views[name + ".entry_ptr"],
                views[name + ".index"],
                views[name + ".count"],
                views[name + ".scale"],
                per_seq,
                max_query_len,
                max(1, max_entries),
            )

        out = AdapterBatch(
            query_start_loc=query_start_loc,
            token_ranges=token_ranges,
            lora={p: entries("lora", p, e) for p, e in self.lora.items()},
            ia3={k: entries("ia3", k, e) for k, e in self.ia3.items()},
            pools=pools,
        )
        if self.virtual_tokens:
            out.virtual_tokens = views["virtual_tokens"]
            out.virtual_rows = views["virtual_rows"]
        return out


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
        key = ia3_key(projection, True)
        entries = self.ia3.get(key)
        if entries is not None:
            table = self.pools.ia3_tables[key][layer]
            ops.ia3_scale(x, [Ia3Slice(table, 0, entries)], self.query_start_loc, self.token_ranges)
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
        """IA³ output scaling, then LoRA deltas, for the projections fused into `y` at their column
        offsets: one operator call for all of them, so a batched kernel serves the fused projection
        (q/k/v, gate/up) in one launch. The projections own disjoint columns, so scaling them all
        before any delta is the same as projection by projection."""
        ia3: list[Ia3Slice] = []
        lora: list[LoraSlice] = []
        for projection, offset in zip(projections, offsets, strict=True):
            key = ia3_key(projection, False)
            if key in self.ia3:
                ia3.append(Ia3Slice(self.pools.ia3_tables[key][layer], offset, self.ia3[key]))
            if projection in self.lora:
                a, bt = self.pools.lora[projection].tensors
                lora.append(LoraSlice(a[layer], bt[layer], offset, self.lora[projection]))
        if ia3:
            ops.ia3_scale(y, ia3, self.query_start_loc, self.token_ranges)
        if lora:
            ops.lora_apply(y, x, lora, self.query_start_loc, self.token_ranges)


def plan_adapters(
    scheduled: list[tuple[Sequence, int]], qsl: np.ndarray, pools: DeviceAdapters
) -> AdapterPlan | None:
    """The step's adapter entries, or None when no scheduled sequence uses an expert. `qsl` has a
    row per scheduled sequence plus any padding rows (which get no entries)."""
    if not any(seq.experts for seq, _ in scheduled):
        return None
    plan = AdapterPlan(rows=len(qsl) - 1)
    for b, (seq, num_new) in enumerate(scheduled):
        soft_rows: list[int] = []
        for use in seq.experts:
            residency = pools.residency(use.expert)
            weights = use.expert.weights
            if weights.lora is not None:
                for projection, pages in residency.lora_pages.items():
                    seq_entries = plan.lora.setdefault(projection, [[] for _ in range(plan.rows)])[b]
                    for i, page in enumerate(pages):
                        count = min(PAGE_ROWS, weights.lora.rank - i * PAGE_ROWS)
                        seq_entries.append((page * PAGE_ROWS, count, use.weight))
            elif weights.ia3 is not None:
                for projection, on_input in weights.ia3.scales_input.items():
                    key = ia3_key(projection, on_input)
                    plan.ia3.setdefault(key, [[] for _ in range(plan.rows)])[b].append(
                        (residency.ia3_slot, 0, use.weight)
                    )
            else:
                soft_rows += residency.soft_rows
        start = seq.num_computed_tokens
        for position in range(start, min(start + num_new, len(soft_rows))):
            plan.virtual_tokens.append(int(qsl[b]) + position - start)
            plan.virtual_rows.append(soft_rows[position])
    return plan
