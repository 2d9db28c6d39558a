"""Decode steps replayed from CUDA graphs: one per padded batch size (and adapter key set).

A decode step of a small model is mostly kernel launches: hundreds per step, each costing the CPU
more than the GPU spends on it. A CUDA graph records the whole step once (the decoder layers and
the LM head) and replays it with one launch. What a graph needs:

- fixed shapes: a step of `rows` sequences is padded up to the next captured size
  (`decode_sizes`); padding rows write no KV and no sampled row reads them (`step_inputs.py`);
- fixed addresses: each captured step owns a device region laid out by its `Layout`; a step's
  staged inputs are copied into it (one device copy) before the replay, and the logits come out of
  a buffer the graph allocated at capture;
- nothing that reads a device value on the host, and kernels whose launch grids come from host
  integers (the Triton operator set, `kernels/gpu.py`).

Graphs without experts are captured at start-up for every size. A step with experts replays the
graph of its adapter key set (which projections carry LoRA or IA³ entries), captured on first use;
entries index the pools through CSR tensors in the region, so any adapters fit the same graph as
long as a row has at most `ENTRIES_PER_ROW` entries per projection. When the pools are reallocated
(they grow by doubling), every expert graph of the older pools is dropped (it no longer counts
toward `VARIANTS_PER_SIZE`) and each key set is captured again on its next use.

A capture that fails for any reason (an operator that cannot be captured, a Triton compile error)
logs a warning and leaves that size and key set eager; the engine starts regardless.

Where no graph can run (the CPU, or `cuda_graphs="on"` there for tests), the same regions,
layouts and padding are used and the step runs eagerly over them: the bookkeeping is one code path.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from libs.engine.graph_tables import ResidentTables
from libs.engine.staging import Layout

log = logging.getLogger(__name__)

DECODE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
ENTRIES_PER_ROW = 32  # per projection in a captured step: up to 256 LoRA rank rows a sequence
VARIANTS_PER_SIZE = 8  # expert key sets captured per size; beyond, such steps run eagerly

Keys = tuple[tuple[str, str], ...]


def decode_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The padded batch sizes that cover 1..max_num_seqs: DECODE_SIZES up to the first that reaches
    max_num_seqs, then multiples of 64 beyond 256."""
    sizes = [s for s in DECODE_SIZES if s < max_num_seqs]
    top = next((s for s in DECODE_SIZES if s >= max_num_seqs), -(-max_num_seqs // 64) * 64)
    sizes += [s for s in range(DECODE_SIZES[-1] + 64, top, 64)] + [top]
    return tuple(sorted(set(sizes)))


@dataclass
class CapturedStep:
    """A decode step of `size` rows and adapter key set `keys`, over its own input region."""

    size: int
    keys: Keys
    layout: Layout  # the model's fields, at the front of every step layout that replays it
    region: torch.Tensor  # [layout.nbytes] uint8 on the device: the graph's inputs
    views: dict[str, torch.Tensor] = field(default_factory=dict)
    adapter_generation: int = 0  # the pools' storage generation the graph was captured over
    tables: ResidentTables | None = None  # what the region's block tables hold (graph_tables.py)
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None  # [size, vocab] float32: written by each replay
    replays: int = 0


# forward(step, plan) -> logits [size, vocab]: the model over `step.views` (plan: the host-side
# adapter plan of a real step, or None while capturing).
Forward = Callable[[CapturedStep, object], torch.Tensor]
# layout_for(size, keys) -> the model fields' layout of a step of that size and key set.
LayoutFor = Callable[[int, Keys], Layout]


class DecodeGraphs:
    """The captured decode steps and when to use them."""

    def __init__(
        self,
        sizes: tuple[int, ...],
        layout_for: LayoutFor,
        forward: Forward,
        device: torch.device,
        capture: bool,
        adapter_generation: Callable[[], int],
    ) -> None:
        self.sizes = sizes
        self.layout_for = layout_for
        self.forward = forward
        self.device = device
        self.capture = capture  # False: replay eagerly (CPU)
        self.adapter_generation = adapter_generation
        self.steps: dict[tuple[int, Keys], CapturedStep] = {}
        self.failed: set[tuple[int, Keys]] = set()
        self.recorder: GraphRecorder | None = CudaGraphRecorder(device) if capture else None
        self._generation = adapter_generation()  # the pools' generation the expert steps were made over
        self.capture_seconds = 0.0
        self.capture_bytes = 0

    def size_for(self, rows: int) -> int | None:
        """The captured size a decode step of `rows` sequences pads to, or None if none is large enough."""
        return next((s for s in self.sizes if s >= rows), None)

    def capture_all(self) -> None:
        """Capture the steps without experts, largest first (the smaller ones reuse its memory)."""
        for size in sorted(self.sizes, reverse=True):
            self.get(size, ())
        if self.capture:
            log.info(
                "captured %d decode graphs (sizes %s) in %.2f s, %.1f MiB of GPU memory",
                sum(1 for s in self.steps.values() if s.graph is not None),
                ",".join(map(str, self.sizes)),
                self.capture_seconds,
                self.capture_bytes / 2**20,
            )

    def get(self, size: int, keys: Keys) -> CapturedStep | None:
        """The step for (size, keys), captured now if it is not yet; None where it cannot be."""
        key = (size, keys)
        if keys:
            self._drop_stale()
        step = self.steps.get(key)
        if step is not None:
            return step
        if key in self.failed:
            return None
        if keys and sum(1 for s, k in self.steps if s == size and k) >= VARIANTS_PER_SIZE:
            return None
        layout = self.layout_for(size, keys)
        region = torch.zeros(layout.nbytes, dtype=torch.uint8, device=self.device)
        step = CapturedStep(
            size,
            keys,
            layout,
            region,
            layout.tensor_views(region),
            self.adapter_generation(),
            ResidentTables(size),
        )
        _fill_idle(step)
        if self.capture and not self._capture(step):
            self.failed.add(key)
            return None
        self.steps[key] = step
        return step

    def replay(
        self, step: CapturedStep, staged: torch.Tensor, plan: object, table_changes: list[torch.Tensor]
    ) -> torch.Tensor:
        """Run `step` on the inputs staged at the front of `staged` (a byte buffer laid out as
        step.layout up to its block tables) after writing `table_changes` (rows, columns, block ids)
        into the block tables the region keeps; returns the logits [size, vocab]."""
        inputs = step.layout.fields["block_tables"].offset
        step.region[:inputs].copy_(staged[:inputs], non_blocking=True)
        rows, cols, blocks = table_changes
        if rows.numel():
            step.views["block_tables"].index_put_((rows, cols), blocks.to(torch.int32))
        step.replays += 1
        if step.graph is not None:
            step.graph.replay()
        else:
            step.logits = self.forward(step, plan)
        return step.logits

    def _drop_stale(self) -> None:
        """Forget every expert step made over pool tensors that were since reallocated, so that the
        key sets in use now can be captured in their place."""
        generation = self.adapter_generation()
        if generation == self._generation:
            return
        self._generation = generation
        for key in [
            k for k, step in self.steps.items() if step.keys and step.adapter_generation != generation
        ]:
            del self.steps[key]
        self.failed = {key for key in self.failed if not key[1]}

    def _capture(self, step: CapturedStep) -> bool:
        recorder = self.recorder
        started = time.monotonic()
        try:
            recorder.synchronize()
            before = recorder.reserved_bytes()
            step.graph, step.logits = recorder.record(lambda: self.forward(step, None))
            recorder.synchronize()
        # Any exception: a Triton compile error is not a RuntimeError, and a size that cannot be
        # captured must leave the engine running, eagerly at that size.
        except Exception as exc:
            step.graph, step.logits = None, None
            log.warning("decode graph of size %d (experts %s) not captured: %s", step.size, step.keys, exc)
            recorder.settle()
            return False
        self.capture_seconds += time.monotonic() - started
        self.capture_bytes += max(0, recorder.reserved_bytes() - before)
        if step.keys:
            log.info("captured the decode graph of size %d for experts on %s", step.size, step.keys)
        return True


class GraphRecorder(Protocol):
    """What capturing needs from the device: the CUDA implementation below, or a test's stand-in."""

    def record(self, forward: Callable[[], torch.Tensor]) -> tuple[object, torch.Tensor]: ...

    def synchronize(self) -> None: ...

    def settle(self) -> None:
        """Wait for the device after a failed capture, without raising again."""

    def reserved_bytes(self) -> int: ...


class CudaGraphRecorder:
    """Records a step in a CUDA graph, every graph in one memory pool (the smaller sizes, captured
    after the largest, reuse its memory)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def record(self, forward: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # Warm-up on a side stream (Triton compiles, cuBLAS picks its kernels), then record.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                forward()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a CUDA call from another thread (the tokenizer's, a logger's) during the
        # capture neither fails it nor is captured into it.
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            logits = forward()
        return graph, logits

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def settle(self) -> None:
        # A failed capture's error can surface again at the next synchronize; it has been logged.
        try:
            torch.cuda.synchronize(self.device)
        except Exception as exc:
            log.warning("synchronizing after a failed capture: %s", exc)

    def reserved_bytes(self) -> int:
        return torch.cuda.memory_reserved(self.device)


def _fill_idle(step: CapturedStep) -> None:
    """Inputs a capture can run on: every row a padding row (one token at position 0 of the null
    block, writing nothing), no adapter entries."""
    v = step.views
    v["query_start_loc"].copy_(torch.arange(step.size + 1, dtype=torch.int32))
    v["seq_lens"].fill_(1)
    v["slot_mapping"].fill_(-1)
