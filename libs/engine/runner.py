"""The model runner: turns a SchedulerOutput into tensors, runs the model, samples. The only part
of the engine that builds tensors.

All index tensors of a step (positions, slots, block tables, sequence boundaries) are built once
here with numpy and shared by every layer. With static decode shapes on, a decode-only batch is
padded to the next size in `decode_sizes` and block tables to a fixed width, so the shapes a GPU
sees repeat and a CUDA graph per size could be captured and replayed.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from libs.engine.adapters.batch import build_adapter_batch
from libs.engine.adapters.device import DeviceAdapters
from libs.engine.grammar import bitmask_width
from libs.engine.kernels import AttentionMetadata
from libs.engine.models.decoder import DecoderModel
from libs.engine.sampler import SampledToken, Sampler, SamplerOutput, SamplingBatch
from libs.engine.scheduler import SchedulerOutput
from libs.engine.sequence import Sequence

DECODE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class ModelRunner:
    def __init__(
        self,
        model: DecoderModel,
        kv_cache: torch.Tensor,
        block_size: int,
        max_model_len: int,
        static_decode_shapes: bool = False,
        adapters: DeviceAdapters | None = None,
    ) -> None:
        self.model = model
        self.adapters = adapters
        self.device = model.device
        self.kv_cache = kv_cache  # [layers, 2, blocks, kv_heads, block_size, head_dim]
        self.kv_caches = [(kv_cache[n, 0], kv_cache[n, 1]) for n in range(kv_cache.shape[0])]
        self.block_size = block_size
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.static_decode_shapes = static_decode_shapes
        self.vocab_size = model.config.vocab_size
        self.sampler = Sampler()

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate source blocks into destinations across all layers."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput) -> dict[int, list[SampledToken]]:
        """Run one step; returns seq_id -> sampled tokens for sequences whose tokens are now all
        computed (several for a sequence that forks into n outputs)."""
        self.copy_blocks(step.blocks_to_copy)
        input_ids, positions, meta, qsl = self._prepare(step)
        adapters = None
        if self.adapters is not None:
            adapters = build_adapter_batch(
                step.scheduled, qsl, meta.query_start_loc, self.adapters, self.device
            )
        hidden = self.model.forward(input_ids, positions, meta, self.kv_caches, adapters)

        # Sample where a sequence's last token was computed; a forking sequence takes n rows.
        rows, row_seqs, seeds = [], [], []
        ends = itertools.accumulate(num_new for _, num_new in step.scheduled)
        for (seq, num_new), end in zip(step.scheduled, ends, strict=True):
            if seq.num_computed_tokens + num_new == seq.num_tokens:
                for seed in seq.sample_seeds():
                    rows.append(end - 1)
                    row_seqs.append(seq)
                    seeds.append(seed)
        if not rows:
            return {}
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
        result = self.sampler(logits, self._sampling_batch(row_seqs, seeds))
        return self._collect(row_seqs, result)

    def _prepare(
        self, step: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, np.ndarray]:
        """Token ids, positions and attention metadata of the step's flat batch (plus padding rows),
        and the query start offsets as numpy."""
        seqs = [seq for seq, _ in step.scheduled]
        q_lens = np.fromiter((n for _, n in step.scheduled), dtype=np.int64, count=len(seqs))
        starts = np.fromiter((s.num_computed_tokens for s in seqs), dtype=np.int64, count=len(seqs))
        pad = self._decode_padding(q_lens)
        num_rows = len(seqs) + pad
        q_lens = np.concatenate([q_lens, np.ones(pad, dtype=np.int64)])
        seq_lens = np.concatenate([starts + q_lens[: len(seqs)], np.ones(pad, dtype=np.int64)])
        qsl = np.zeros(num_rows + 1, dtype=np.int64)
        np.cumsum(q_lens, out=qsl[1:])
        total = int(qsl[-1])

        width = (
            self.max_blocks_per_seq if self.static_decode_shapes else max(len(s.block_table) for s in seqs)
        )
        tables = np.zeros((num_rows, width), dtype=np.int32)  # padding points at the null block
        for row, seq in enumerate(seqs):
            tables[row, : len(seq.block_table)] = seq.block_table

        row_of_token = np.repeat(np.arange(num_rows), q_lens)
        positions = np.repeat(seq_lens - q_lens, q_lens) + (np.arange(total) - np.repeat(qsl[:-1], q_lens))
        slots = tables[row_of_token, positions // self.block_size].astype(np.int64) * self.block_size
        slots += positions % self.block_size
        if pad:
            slots[-pad:] = -1  # padding rows write nothing
        input_ids = np.zeros(total, dtype=np.int64)
        for seq, start, end, first in zip(
            seqs, qsl[:-1].tolist(), qsl[1:].tolist(), starts.tolist(), strict=False
        ):
            input_ids[start:end] = seq.token_ids[first : first + end - start]

        to = self._tensor
        meta = AttentionMetadata(
            query_start_loc=to(qsl, torch.int32),
            seq_lens=to(seq_lens, torch.int32),
            block_tables=to(tables, torch.int32),
            slot_mapping=to(slots, torch.int64),
            max_query_len=int(q_lens.max()),
            max_seq_len=int(seq_lens.max()),
            block_size=self.block_size,
        )
        return to(input_ids, torch.int64), to(positions, torch.int64), meta, qsl

    def _decode_padding(self, q_lens: np.ndarray) -> int:
        if not self.static_decode_shapes or q_lens.max() != 1:
            return 0
        size = next((s for s in DECODE_SIZES if s >= len(q_lens)), len(q_lens))
        return size - len(q_lens)

    def _tensor(self, array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(device=self.device, dtype=dtype)

    def _sampling_batch(self, seqs: list[Sequence], seeds: list[int]) -> SamplingBatch:
        params = [s.params for s in seqs]
        dev = self.device

        def column(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=dev)

        batch = SamplingBatch(
            temperature=column([p.temperature for p in params], torch.float32),
            top_k=column([p.top_k for p in params], torch.int64),
            top_p=column([p.top_p for p in params], torch.float32),
            min_p=column([p.min_p for p in params], torch.float32),
            seed_lo=column([s & 0xFFFFFFFF for s in seeds], torch.int64),
            seed_hi=column([s >> 32 for s in seeds], torch.int64),
            step=column([s.num_output_tokens for s in seqs], torch.int64),
            num_logprobs=max((p.logprobs for p in params if p.logprobs is not None), default=-1),
            all_greedy=all(p.greedy for p in params),
            any_top_k=any(p.top_k > 0 for p in params),
            any_top_p=any(p.top_p < 1.0 for p in params),
            any_min_p=any(p.min_p > 0.0 for p in params),
        )
        if any(p.uses_penalties for p in params):
            batch.repetition_penalty = column([p.repetition_penalty for p in params], torch.float32)
            batch.presence_penalty = column([p.presence_penalty for p in params], torch.float32)
            batch.frequency_penalty = column([p.frequency_penalty for p in params], torch.float32)
            batch.prompt_tokens = self._padded([s.prompt_token_ids for s in seqs])
            batch.output_tokens = self._padded([s.output_token_ids for s in seqs])
            batch.penalty_exempt = self._padded([list(s.penalty_exempt_ids) for s in seqs])
        constrained = [i for i, s in enumerate(seqs) if s.grammar is not None]
        if constrained:
            batch.constrained_rows = column(constrained, torch.int64)
            batch.allowed_tokens = self._allowed_tokens([seqs[i] for i in constrained]).to(dev)
        return batch

    def _allowed_tokens(self, seqs: list[Sequence]) -> torch.Tensor:
        """The constrained rows' token bitmasks, filled by their matchers on the CPU (llguidance
        writes straight into the tensor). The n rows of a forking sequence share one mask."""
        bitmask = torch.empty((len(seqs), bitmask_width(self.vocab_size)), dtype=torch.int32)
        for row, seq in enumerate(seqs):
            if row and seq is seqs[row - 1]:
                bitmask[row] = bitmask[row - 1]
            else:
                seq.grammar.fill(bitmask, row)
        return bitmask

    def _padded(self, rows: list[list[int]]) -> torch.Tensor:
        width = max(1, max(len(r) for r in rows))
        out = np.full((len(rows), width), self.vocab_size, dtype=np.int64)
        for i, r in enumerate(rows):
            out[i, : len(r)] = r
        return self._tensor(out, torch.int64)

    @staticmethod
    def _collect(seqs: list[Sequence], result: SamplerOutput) -> dict[int, list[SampledToken]]:
        tokens = result.token_ids.tolist()
        sampled = result.sampled_logprobs.tolist() if result.sampled_logprobs is not None else None
        ranks = result.sampled_ranks.tolist() if result.sampled_ranks is not None else None
        top_ids = result.top_token_ids.tolist() if result.top_token_ids is not None else None
        top_vals = result.top_logprobs.tolist() if result.top_logprobs is not None else None
        out: dict[int, list[SampledToken]] = {}
        for i, seq in enumerate(seqs):
            wanted = seq.params.logprobs
            top: tuple[tuple[int, float], ...] = ()
            if wanted and top_ids is not None:
                top = tuple(zip(top_ids[i][:wanted], top_vals[i][:wanted], strict=True))
            if sampled is not None and ranks is not None and wanted is not None:
                sample = SampledToken(tokens[i], sampled[i], ranks[i], top)
            else:
                sample = SampledToken(tokens[i])
            out.setdefault(seq.seq_id, []).append(sample)
        return out
