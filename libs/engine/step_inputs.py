"""What a step feeds the model and the sampler, laid out in the staging buffer (`staging.py`).

`StepShape` is a step's host-side plan: its sequences, their query lengths and padding rows.
`add_model_fields` / `fill_model_fields` lay out and write token ids, positions, slots, query starts,
sequence lengths and block tables (plus the adapter entries, `adapters/batch.py`);
`add_sampling_fields` / `fill_sampling_fields` the sampled rows and every row's sampling settings,
`add_mask_fields` / `fill_mask_fields` the structured-output masks (staged after the forward pass
is queued, so that the host computes them while the device runs it).
The layout of the model's fields depends only on (rows, tokens, block-table width, adapter key set
and capacities), so a CUDA graph captured for one layout replays for every step that fits it.

Padding rows (a decode batch padded up to a captured size) are sequences of one token at position
0 whose slot is -1 (nothing is written) and whose block table is the null block: they compute
garbage that no sampled row reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from libs.engine.grammar import bitmask_width
from libs.engine.kernels import AttentionMetadata
from libs.engine.sampler import SamplingBatch
from libs.engine.sequence import Sequence
from libs.engine.staging import Layout


@dataclass
class StepShape:
    """A step's sequences as the runner lays them out: real rows first, then `pad` padding rows."""

    seqs: list[Sequence]
    q_lens: np.ndarray  # [rows] int64, padding rows included (1 each)
    starts: np.ndarray  # [real rows] int64: tokens already in the cache
    pad: int
    width: int  # block-table columns

    @classmethod
    def build(cls, scheduled: list[tuple[Sequence, int]], pad: int, width: int | None) -> StepShape:
        seqs = [seq for seq, _ in scheduled]
        q_lens = np.fromiter((n for _, n in scheduled), dtype=np.int64, count=len(seqs))
        starts = np.fromiter((s.num_computed_tokens for s in seqs), dtype=np.int64, count=len(seqs))
        if width is None:
            width = max(len(s.block_table) for s in seqs)
        return cls(seqs, np.concatenate([q_lens, np.ones(pad, dtype=np.int64)]), starts, pad, width)

    def padded(self, rows: int, width: int) -> StepShape:
        """The same step padded with one-token rows up to `rows`, with block tables `width` wide."""
        pad = rows - len(self.seqs)
        q_lens = np.concatenate([self.q_lens[: len(self.seqs)], np.ones(pad, dtype=np.int64)])
        return StepShape(self.seqs, q_lens, self.starts, pad, width)

    @property
    def num_rows(self) -> int:
        return len(self.q_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.q_lens.sum())

    @property
    def query_start_loc(self) -> np.ndarray:
        qsl = np.zeros(self.num_rows + 1, dtype=np.int64)
        np.cumsum(self.q_lens, out=qsl[1:])
        return qsl

    @property
    def seq_lens(self) -> np.ndarray:
        return np.concatenate(
            [self.starts + self.q_lens[: len(self.seqs)], np.ones(self.pad, dtype=np.int64)]
        )


def add_model_fields(layout: Layout, rows: int, tokens: int, width: int | None) -> None:
    """The model's fields; block tables `width` wide, or none (width None: a decode graph keeps
    its tables on the device, `graph_tables.py`)."""
    layout.add("input_ids", torch.int64, tokens)
    layout.add("positions", torch.int64, tokens)
    layout.add("slot_mapping", torch.int64, tokens)
    layout.add("query_start_loc", torch.int32, rows + 1)
    layout.add("seq_lens", torch.int32, rows)
    if width is not None:
        layout.add("block_tables", torch.int32, rows, width)


def fill_model_fields(views: dict[str, np.ndarray], shape: StepShape, block_size: int) -> None:
    """Token ids, positions, slots, query starts, lengths and block tables of the step (views zeroed)."""
    qsl, seq_lens, q_lens = shape.query_start_loc, shape.seq_lens, shape.q_lens
    total = int(qsl[-1])
    views["query_start_loc"][:] = qsl
    views["seq_lens"][:] = seq_lens
    positions = np.repeat(seq_lens - q_lens, q_lens) + (np.arange(total) - np.repeat(qsl[:-1], q_lens))
    slots = views["slot_mapping"]
    if "block_tables" in views:
        tables = views["block_tables"]  # padding rows and columns stay 0: the null block
        for row, seq in enumerate(shape.seqs):
            tables[row, : len(seq.block_table)] = seq.block_table
        row_of_token = np.repeat(np.arange(shape.num_rows), q_lens)
        slots[:] = tables[row_of_token, positions // block_size].astype(np.int64) * block_size
    else:  # a decode graph's step: one token per real row, its block from the sequence's table
        real = len(shape.seqs)
        slots[:real] = np.fromiter(
            (
                seq.block_table[p // block_size]
                for seq, p in zip(shape.seqs, positions[:real].tolist(), strict=True)
            ),
            np.int64,
            real,
        )
        slots[:real] *= block_size
    slots += positions % block_size
    if shape.pad:
        slots[total - shape.pad :] = -1  # padding rows write nothing
    views["positions"][:] = positions
    input_ids = views["input_ids"]
    for seq, start, end, first in zip(
        shape.seqs, qsl[:-1].tolist(), qsl[1:].tolist(), shape.starts.tolist(), strict=False
    ):
        input_ids[start:end] = seq.token_ids[first : first + end - start]


def attention_metadata(
    views: dict[str, torch.Tensor], max_query_len: int, max_seq_len: int, block_size: int
) -> AttentionMetadata:
    return AttentionMetadata(
        query_start_loc=views["query_start_loc"],
        seq_lens=views["seq_lens"],
        block_tables=views["block_tables"],
        slot_mapping=views["slot_mapping"],
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        block_size=block_size,
    )


@dataclass
class SampleRows:
    """The rows to sample: one per sequence whose last token was computed, n for a forking one, and
    one per position for a sequence verifying drafts (its last real token and each draft)."""

    rows: list[int]  # flat token index of each sampled row
    seqs: list[Sequence]
    seeds: list[int]
    # Per row, how many of its sequence's drafts come before it (0 for every ordinary row): the
    # row samples output position (real outputs + offset) after those drafts.
    offsets: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.offsets:
            self.offsets = [0] * len(self.rows)

    @classmethod
    def of(cls, scheduled: list[tuple[Sequence, int]], qsl: np.ndarray) -> SampleRows:
        out = cls([], [], [], [])
        for b, (seq, num_new) in enumerate(scheduled):
            if seq.num_computed_tokens + num_new != seq.num_tokens:
                continue
            end = int(qsl[b + 1]) - 1
            drafts = seq.num_draft_tokens
            if drafts:
                for offset in range(drafts + 1):
                    out._add(end - drafts + offset, seq, seq.seed, offset)
            else:
                for seed in seq.sample_seeds():
                    out._add(end, seq, seed, 0)
        return out

    def _add(self, row: int, seq: Sequence, seed: int, offset: int) -> None:
        self.rows.append(row)
        self.seqs.append(seq)
        self.seeds.append(seed)
        self.offsets.append(offset)

    def output_tokens(self, i: int) -> list[int]:
        """The output tokens before row i's position (its sequence's real ones and earlier drafts)."""
        seq = self.seqs[i]
        return seq.output_token_ids[: seq.num_output_tokens - seq.num_draft_tokens + self.offsets[i]]


_PENALTIES = ("repetition_penalty", "presence_penalty", "frequency_penalty")
_PADDED_TOKENS = ("prompt_tokens", "output_tokens", "penalty_exempt")


def add_sampling_fields(layout: Layout, sample: SampleRows, vocab_size: int) -> None:
    s = len(sample.rows)
    layout.add("sample_rows", torch.int64, s)
    for name in ("temperature", "top_p", "min_p"):
        layout.add(name, torch.float32, s)
    for name in ("top_k", "seed_lo", "seed_hi", "step"):
        layout.add(name, torch.int64, s)
    params = [q.params for q in sample.seqs]
    if any(p.uses_penalties for p in params):
        for name in _PENALTIES:
            layout.add(name, torch.float32, s)
        for name, width in zip(_PADDED_TOKENS, _token_widths(sample.seqs), strict=True):
            layout.add(name, torch.int64, s, width)


def add_mask_fields(layout: Layout, sample: SampleRows, vocab_size: int) -> bool:
    """The constrained rows and their bitmasks of allowed tokens, staged apart from the other
    inputs: the runner fills them while the forward pass runs. False if no row is constrained."""
    constrained = sum(1 for q in sample.seqs if q.grammar is not None)
    if constrained:
        layout.add("constrained_rows", torch.int64, constrained)
        layout.add("allowed_tokens", torch.int32, constrained, bitmask_width(vocab_size))
    return bool(constrained)


def _token_widths(seqs: list[Sequence]) -> tuple[int, int, int]:
    return (
        max(1, max(len(q.prompt_token_ids) for q in seqs)),
        max(1, max(q.num_output_tokens for q in seqs)),
        max(1, max(len(q.penalty_exempt_ids) for q in seqs)),
    )


def fill_sampling_fields(views: dict[str, np.ndarray], sample: SampleRows, vocab_size: int) -> None:
    """Each sampled row's settings; penalty token lists padded with `vocab_size`."""
    seqs, params = sample.seqs, [q.params for q in sample.seqs]
    s = len(seqs)
    views["sample_rows"][:] = sample.rows
    views["temperature"][:] = np.fromiter((p.temperature for p in params), np.float32, s)
    views["top_k"][:] = np.fromiter((p.top_k for p in params), np.int64, s)
    views["top_p"][:] = np.fromiter((p.top_p for p in params), np.float32, s)
    views["min_p"][:] = np.fromiter((p.min_p for p in params), np.float32, s)
    seeds = np.array(sample.seeds, dtype=np.uint64)
    views["seed_lo"][:] = (seeds & np.uint64(0xFFFFFFFF)).astype(np.int64)
    views["seed_hi"][:] = (seeds >> np.uint64(32)).astype(np.int64)
    views["step"][:] = np.fromiter(
        (q.num_output_tokens - q.num_draft_tokens + o for q, o in zip(seqs, sample.offsets, strict=True)),
        np.int64,
        s,
    )
    if "repetition_penalty" in views:
        for name in _PENALTIES:
            views[name][:] = np.fromiter((getattr(p, name) for p in params), np.float32, s)
        lists = (
            [q.prompt_token_ids for q in seqs],
            [sample.output_tokens(i) for i in range(s)],
            [list(q.penalty_exempt_ids) for q in seqs],
        )
        for name, rows in zip(_PADDED_TOKENS, lists, strict=True):
            out = views[name]
            out.fill(vocab_size)
            for i, r in enumerate(rows):
                out[i, : len(r)] = r


def fill_mask_fields(views: dict[str, np.ndarray], sample: SampleRows) -> None:
    """The constrained rows' bitmasks from their matchers. The n rows of a forking sequence share
    one mask; a verifying sequence's matcher steps over each draft to give the next row its mask,
    then rolls back, so it only ever advances over tokens the output keeps (Request.on_token)."""
    seqs, offsets = sample.seqs, sample.offsets
    constrained = [i for i, q in enumerate(seqs) if q.grammar is not None]
    views["constrained_rows"][:] = constrained
    bitmask = torch.from_numpy(views["allowed_tokens"])
    for row, i in enumerate(constrained):
        seq, offset = seqs[i], offsets[i]
        if offset:
            seq.grammar.accept(seq.draft_token_ids[offset - 1])
        if row and offset == 0 and seq is seqs[constrained[row - 1]]:
            bitmask[row] = bitmask[row - 1]
        else:
            seq.grammar.fill(bitmask, row)
        if offset and offset == seq.num_draft_tokens:
            seq.grammar.rollback(offset)


def sampling_batch(views: dict[str, torch.Tensor], sample: SampleRows) -> SamplingBatch:
    """The sampler's batch over the staged device views, with the host-side flags that pick its paths."""
    params = [q.params for q in sample.seqs]
    batch = SamplingBatch(
        temperature=views["temperature"],
        top_k=views["top_k"],
        top_p=views["top_p"],
        min_p=views["min_p"],
        seed_lo=views["seed_lo"],
        seed_hi=views["seed_hi"],
        step=views["step"],
        num_logprobs=max(
            (q.num_top_logprobs for q in sample.seqs if q.num_top_logprobs is not None), default=-1
        ),
        all_greedy=all(p.greedy for p in params),
        any_top_k=any(p.top_k > 0 for p in params),
        any_top_p=any(p.top_p < 1.0 for p in params),
        any_min_p=any(p.min_p > 0.0 for p in params),
        max_top_k=max((p.top_k for p in params), default=0),
    )
    if "repetition_penalty" in views:
        for name in (*_PENALTIES, *_PADDED_TOKENS):
            setattr(batch, name, views[name])
    if "constrained_rows" in views:
        batch.constrained_rows = views["constrained_rows"]
        batch.allowed_tokens = views["allowed_tokens"]
    return batch
