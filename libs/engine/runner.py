"""The model runner: turns a SchedulerOutput into tensors, runs the model, samples. The only part
of the engine that builds tensors.

A step's inputs (token ids, positions, slots, block tables, sequence lengths, adapter entries and
sampling settings) are written with numpy into one staging buffer and sent to the device in one
copy (`staging.py`, `step_inputs.py`). With graphs on, a decode-only step is padded to the next
captured size and replayed from a CUDA graph (`cuda_graphs.py`); prefills and mixed steps run
eagerly. Either way the model's output rows are gathered for the rows that sample, and the sampler
draws every row at once.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from libs.engine.adapters.batch import AdapterBatch, AdapterPlan, plan_adapters
from libs.engine.adapters.device import DeviceAdapters
from libs.engine.cuda_graphs import ENTRIES_PER_ROW, CapturedStep, DecodeGraphs, Keys, decode_sizes
from libs.engine.models.decoder import DecoderModel
from libs.engine.sampler import SampledToken, Sampler, SamplerOutput
from libs.engine.scheduler import SchedulerOutput
from libs.engine.sequence import Sequence
from libs.engine.speculative_sampling import RejectionRows
from libs.engine.staging import Layout, StagingBuffers
from libs.engine.step_inputs import (
    SampleRows,
    StepShape,
    add_mask_fields,
    add_model_fields,
    add_sampling_fields,
    attention_metadata,
    fill_mask_fields,
    fill_model_fields,
    fill_sampling_fields,
    sampling_batch,
)

GRAPH_MODES = ("capture", "eager")
TABLE_CHANGES = (
    "table_rows",
    "table_cols",
    "table_blocks",
)  # a captured step's block-table entries to write  # CUDA graphs, or the same padded steps run eagerly (CPU)


class ModelRunner:
    def __init__(
        self,
        model: DecoderModel,
        kv_cache: torch.Tensor,
        block_size: int,
        max_model_len: int,
        max_num_seqs: int = 64,
        graphs: str | None = None,
        adapters: DeviceAdapters | None = None,
    ) -> None:
        self.model = model
        self.adapters = adapters
        self.device = model.device
        self.kv_cache = kv_cache  # [layers, 2, blocks, kv_heads, block_size, head_dim (+ 4 if int8)]
        self.kv_caches = [(kv_cache[n, 0], kv_cache[n, 1]) for n in range(kv_cache.shape[0])]
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.vocab_size = model.config.vocab_size
        self.staging = StagingBuffers(self.device)
        # The structured-output masks: staged after the forward pass is queued (computing them is
        # host work that then overlaps the device's), in a buffer pair of their own.
        self.mask_staging = StagingBuffers(self.device)
        # On a GPU nothing in sampling may wait for the device (no branch on a device value).
        self.sampler = Sampler(
            sync_free=self.device.type == "cuda", argmax=model.ops.argmax, top_p_cutoff=model.ops.top_p_cutoff
        )
        # Speculative decoding with a model drafter: the rows whose tokens the rejection rule decides
        # (drafters/verification.py PendingDrafts.rejection_rows), set by the engine.
        self.rejection_rows: Callable[[SampleRows], RejectionRows | None] | None = None
        self.graphs: DecodeGraphs | None = None
        if graphs is not None:
            if graphs not in GRAPH_MODES:
                raise ValueError(f"graphs: expected one of {', '.join(GRAPH_MODES)} or None, got {graphs!r}")
            self.graphs = DecodeGraphs(
                decode_sizes(max_num_seqs),
                self._decode_layout,
                self._decode_forward,
                self.device,
                capture=graphs == "capture",
                adapter_generation=lambda: 0 if adapters is None else adapters.storage_generation,
            )
            self.graphs.capture_all()

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
        launched = self.launch(step)
        return {} if launched is None else self.collect(launched)

    @torch.inference_mode()
    def launch(self, step: SchedulerOutput, previous: Launched | None = None) -> Launched | None:
        """Queue one step on the device and return its sampled tokens still there (None if no row
        samples): nothing here waits for the device. `previous`: the step before, whose tokens the
        host has not read yet; a scheduled sequence whose last token is still a placeholder takes it
        from there, on the device (asynchronous scheduling)."""
        self.copy_blocks(step.blocks_to_copy)
        shape = StepShape.build(step.scheduled, 0, None)
        qsl = shape.query_start_loc
        plan = None if self.adapters is None else plan_adapters(step.scheduled, qsl, self.adapters)
        captured = self._graph_for(step, plan)
        if captured is not None:
            shape = shape.padded(captured.size, self.max_blocks_per_seq)
            qsl = shape.query_start_loc
            plan = None if plan is None else plan.padded(captured.size)
        sample = SampleRows.of(step.scheduled, qsl)
        carried = _carried_tokens(step.scheduled, qsl, previous)

        views = self._stage(shape, plan, sample, captured, carried, previous)

        if captured is not None:
            logits = self.graphs.replay(captured, self.staging.dev, plan, [views[n] for n in TABLE_CHANGES])
            if not sample.rows:
                return None
            logits = logits.index_select(0, views["sample_rows"])
        else:
            hidden = self._forward(views, shape, plan)
            if not sample.rows:
                return None
            logits = self.model.compute_logits(hidden.index_select(0, views["sample_rows"]))
        masks = Layout()
        if add_mask_fields(masks, sample, self.vocab_size):
            fill_mask_fields(self.mask_staging.stage(masks), sample)
            views = views | self.mask_staging.send(masks)
        rejection = None if self.rejection_rows is None else self.rejection_rows(sample)
        result = self.sampler(logits, sampling_batch(views, sample), rejection)
        return Launched(sample.seqs, result)

    def _stage(
        self,
        shape: StepShape,
        plan: AdapterPlan | None,
        sample: SampleRows,
        captured: CapturedStep | None,
        carried: tuple[np.ndarray, np.ndarray] | None,
        previous: Launched | None,
    ) -> dict[str, torch.Tensor]:
        """The step's inputs written on the host and sent in one copy; device views of them."""
        # A captured step stages what its region takes each replay, and its tables' changes.
        layout = captured.layout.before("block_tables") if captured else Layout()
        if captured is None:
            add_model_fields(layout, shape.num_rows, shape.num_tokens, shape.width)
            if plan is not None:
                plan.add_fields(layout, plan.entry_counts())
        if sample.rows:
            add_sampling_fields(layout, sample, self.vocab_size)
        indices = _device_indices(shape, captured, carried)
        for name, values in indices.items():
            layout.add(name, torch.int64, len(values))
        host = self.staging.stage(layout)
        fill_model_fields(host, shape, self.block_size)
        if plan is not None:
            plan.fill(host)
        if sample.rows:
            fill_sampling_fields(host, sample, self.vocab_size)
        for name, values in indices.items():
            host[name][:] = values
        views = self.staging.send(layout)
        if carried is not None:  # the placeholders' values, from the previous step's device output
            tokens = previous.result.token_ids.index_select(0, views["carried_from"])
            views["input_ids"].index_copy_(0, views["carried_to"], tokens)
        return views

    def collect(self, launched: Launched) -> dict[int, list[SampledToken]]:
        """A launched step's sampled tokens on the host (this waits for the device)."""
        return _collect(launched.seqs, launched.result)

    # -- eager steps ---------------------------------------------------------------------------

    def _forward(
        self, views: dict[str, torch.Tensor], shape: StepShape, plan: AdapterPlan | None
    ) -> torch.Tensor:
        max_query_len = int(shape.q_lens.max())
        meta = attention_metadata(views, max_query_len, int(shape.seq_lens.max()), self.block_size)
        adapters = None
        if plan is not None:
            qsl = shape.query_start_loc
            adapters = plan.batch(
                views,
                meta.query_start_loc,
                _ranges(qsl),
                self.adapters,
                max_query_len,
                plan.max_entries,
            )
        return self.model.forward(views["input_ids"], views["positions"], meta, self.kv_caches, adapters)

    # -- graph steps ---------------------------------------------------------------------------

    def _graph_for(self, step: SchedulerOutput, plan: AdapterPlan | None) -> CapturedStep | None:
        """The captured step a decode-only step replays, or None: it runs eagerly (not decode-only,
        too many rows, soft-prompt tokens, or more adapter entries per row than a graph holds)."""
        if self.graphs is None or any(n != 1 for _, n in step.scheduled):
            return None
        size = self.graphs.size_for(len(step.scheduled))
        if size is None:
            return None
        if plan is not None and (plan.virtual_tokens or plan.max_entries > ENTRIES_PER_ROW):
            return None
        return self.graphs.get(size, () if plan is None else plan.keys)

    def _decode_layout(self, size: int, keys: Keys) -> Layout:
        """A captured step's region: the staged inputs, then the block tables it keeps (last, so
        that a replay's one copy of the staged inputs leaves them alone)."""
        layout = Layout()
        add_model_fields(layout, size, size, None)
        if keys:
            _empty_plan(size, keys).add_fields(layout, dict.fromkeys(keys, size * ENTRIES_PER_ROW))
        layout.add("block_tables", torch.int32, size, self.max_blocks_per_seq)
        return layout

    def _decode_forward(self, captured: CapturedStep, plan: AdapterPlan | None) -> torch.Tensor:
        """The model over a captured step's region: logits [size, vocab] for every row. `plan` is the
        real step's (eager replays, whose torch operators read its lists), or None (capture)."""
        views, size = captured.views, captured.size
        max_seq_len = self.max_model_len
        if plan is None or captured.graph is not None:
            plan = _empty_plan(size, captured.keys) if captured.keys else None
        else:  # an eager replay: the reference operators size their work by the real lengths
            max_seq_len = int(views["seq_lens"].max())
        meta = attention_metadata(views, 1, max_seq_len, self.block_size)
        adapters: AdapterBatch | None = None
        if plan is not None:
            adapters = plan.batch(
                views, meta.query_start_loc, _ranges(np.arange(size + 1)), self.adapters, 1, ENTRIES_PER_ROW
            )
        hidden = self.model.forward(views["input_ids"], views["positions"], meta, self.kv_caches, adapters)
        return self.model.compute_logits(hidden)


@dataclass
class Launched:
    """A step queued on the device: the sequence of each sampled row and the sampler's output."""

    seqs: list[Sequence]
    result: SamplerOutput

    def row_of(self) -> dict[int, int]:
        """seq_id -> its sampled row (one row per sequence in a step that runs ahead)."""
        return {seq.seq_id: i for i, seq in enumerate(self.seqs)}


def _device_indices(
    shape: StepShape, captured: CapturedStep | None, carried: tuple[np.ndarray, np.ndarray] | None
) -> dict[str, np.ndarray]:
    """Index lists a step stages for work on the device: where the carried tokens go and come
    from, and a captured step's block-table changes."""
    indices = {}
    if carried is not None:
        indices["carried_to"], indices["carried_from"] = carried
    if captured is not None:
        indices.update(zip(TABLE_CHANGES, captured.tables.changes(shape.seqs), strict=True))
    return indices


def _carried_tokens(
    scheduled: list[tuple[Sequence, int]], qsl: np.ndarray, previous: Launched | None
) -> tuple[np.ndarray, np.ndarray] | None:
    """For the scheduled sequences whose last token is a placeholder: that token's index in this
    step's input ids and its row in the previous step's samples; None if there are none."""
    if previous is None:
        return None
    rows = previous.row_of()
    to, frm = [], []
    for b, (seq, num_new) in enumerate(scheduled):
        if not seq.num_placeholders:
            continue
        # The one pending placeholder is the sequence's last token; it is in this step when the
        # step's tokens reach the end of the sequence.
        if seq.num_computed_tokens + num_new == seq.num_tokens:
            to.append(int(qsl[b + 1]) - 1)
            frm.append(rows[seq.seq_id])
    if not to:
        return None
    return np.array(to, dtype=np.int64), np.array(frm, dtype=np.int64)


def _ranges(qsl: np.ndarray) -> list[tuple[int, int]]:
    return list(itertools.pairwise(qsl.tolist()))


def _empty_plan(rows: int, keys: Keys) -> AdapterPlan:
    plan = AdapterPlan(rows=rows)
    for kind, key in keys:
        (plan.lora if kind == "lora" else plan.ia3)[key] = [[] for _ in range(rows)]
    return plan


def _collect(seqs: list[Sequence], result: SamplerOutput) -> dict[int, list[SampledToken]]:
    tokens = result.token_ids.tolist()
    sampled = result.sampled_logprobs.tolist() if result.sampled_logprobs is not None else None
    ranks = result.sampled_ranks.tolist() if result.sampled_ranks is not None else None
    top_ids = result.top_token_ids.tolist() if result.top_token_ids is not None else None
    top_vals = result.top_logprobs.tolist() if result.top_logprobs is not None else None
    out: dict[int, list[SampledToken]] = {}
    for i, seq in enumerate(seqs):
        wanted = seq.num_top_logprobs
        top: tuple[tuple[int, float], ...] = ()
        if wanted and top_ids is not None:
            top = tuple(zip(top_ids[i][:wanted], top_vals[i][:wanted], strict=True))
        if sampled is not None and ranks is not None and wanted is not None:
            sample = SampledToken(tokens[i], sampled[i], ranks[i], top)
        else:
            sample = SampledToken(tokens[i])
        out.setdefault(seq.seq_id, []).append(sample)
    return out
