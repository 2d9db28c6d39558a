"""The decode-graph runner's bookkeeping, run on the CPU: `cuda_graphs="on"` pads decode steps to
the captured sizes and runs them over the captured steps' own input regions, exactly as a CUDA
graph replays them, only eagerly (no GPU here: the capture itself, `torch.cuda.CUDAGraph`, is the
one part this cannot run). With the native kernels, whose rows do not depend on the batch, padded
steps give bitwise the tokens of unpadded ones."""

from __future__ import annotations

import pytest
import torch

from libs.engine import LLMEngine, SamplingParams
from libs.engine.cuda_graphs import DECODE_SIZES, VARIANTS_PER_SIZE, DecodeGraphs, decode_sizes
from libs.engine.staging import Layout

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=12, ignore_eos=True, seed=7)


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, 300, (int(torch.randint(2, 30, (1,), generator=g)),), generator=g).tolist()
        for _ in range(count)
    ]


def _engine(tiny_llama, **settings) -> LLMEngine:
    return LLMEngine.from_pretrained(str(tiny_llama), max_model_len=256, num_blocks=200, **settings)


@pytest.fixture(scope="module")
def plain(tiny_llama) -> LLMEngine:
    return _engine(tiny_llama, cuda_graphs="off")


@pytest.fixture(scope="module")
def graphed(tiny_llama) -> LLMEngine:
    return _engine(tiny_llama, cuda_graphs="on", max_num_seqs=16)


def test_the_sizes_cover_every_batch_up_to_max_num_seqs():
    assert decode_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 48, 64)
    assert decode_sizes(50) == (1, 2, 4, 8, 16, 24, 32, 48, 64)
    assert decode_sizes(1) == (1,)
    assert decode_sizes(300) == (*DECODE_SIZES, 320)
    for n in range(1, 300):
        graphs = DecodeGraphs(decode_sizes(n), None, None, torch.device("cpu"), False, lambda: 0)
        assert graphs.size_for(n) >= n


def test_start_up_prepares_a_step_per_size_without_experts(graphed):
    steps = graphed.runner.graphs.steps
    assert set(steps) == {(size, ()) for size in (1, 2, 4, 8, 16)}
    assert all(step.graph is None for step in steps.values())  # the CPU runs them eagerly


def test_a_decode_step_replays_the_next_size_up(graphed):
    graphs = graphed.runner.graphs
    before = {key: step.replays for key, step in graphs.steps.items()}
    graphed.generate(_prompts(5, seed=1), GREEDY)
    replayed = {key for key, step in graphs.steps.items() if step.replays > before[key]}
    assert (8, ()) in replayed  # five sequences decode as a batch of eight


def test_padded_steps_give_the_tokens_of_unpadded_ones(plain, graphed):
    prompts = _prompts(5, seed=2)
    for params in (GREEDY, SEEDED):
        expected = [o.token_ids for o in plain.generate(prompts, params)]
        assert [o.token_ids for o in graphed.generate(prompts, params)] == expected


def test_block_tables_kept_in_the_graph_regions_follow_rows_as_sequences_come_and_go(tiny_llama, plain):
    # Four-token blocks: every few steps a sequence gains a block; outputs of different lengths
    # end at different steps, so the rows below them move up and take other sequences' tables.
    small = {"max_model_len": 256, "num_blocks": 400, "block_size": 4}
    graphed = LLMEngine.from_pretrained(str(tiny_llama), cuda_graphs="on", max_num_seqs=8, **small)
    eager = LLMEngine.from_pretrained(str(tiny_llama), cuda_graphs="off", **small)
    prompts = _prompts(6, seed=11)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (5, 30, 9, 22, 14, 3)]
    expected = [o.token_ids for o in eager.generate(prompts, params)]
    assert [o.token_ids for o in graphed.generate(prompts, params)] == expected
    assert sum(step.replays for step in graphed.runner.graphs.steps.values()) > 20


def test_padding_rows_write_no_kv(graphed):
    # Padding rows point at the null block 0 with slot -1: block 0 stays zero however many run.
    graphed.generate(_prompts(3, seed=3), GREEDY)
    assert not graphed.runner.kv_cache[:, :, 0].any()


def test_a_size_reads_its_inputs_from_the_same_buffers_every_step(graphed):
    seen: list[tuple[int, int, int]] = []
    forward = graphed.model.forward

    def recording(input_ids, positions, meta, kv_caches, adapters=None):
        if meta.max_query_len == 1:
            seen.append((input_ids.shape[0], input_ids.data_ptr(), meta.block_tables.data_ptr()))
        return forward(input_ids, positions, meta, kv_caches, adapters)

    graphed.model.forward = recording
    try:
        graphed.generate(_prompts(6, seed=4), GREEDY)
    finally:
        del graphed.model.forward
    by_size: dict[int, set[tuple[int, int]]] = {}
    for rows, ids, tables in seen:
        by_size.setdefault(rows, set()).add((ids, tables))
    assert 8 in by_size
    for size, pointers in by_size.items():
        assert len(pointers) == 1  # every step of this size: the same input ids and block tables
        ((ids, _),) = pointers
        region = graphed.runner.graphs.steps[(size, ())].region
        assert region.data_ptr() <= ids < region.data_ptr() + region.numel()  # in the size's own region


def test_prefills_and_batches_past_the_largest_size_run_eagerly(tiny_llama):
    engine = _engine(tiny_llama, cuda_graphs="on", max_num_seqs=16)
    engine.runner.graphs.sizes = (1, 2)  # as if only these had been captured
    before = sum(step.replays for step in engine.runner.graphs.steps.values())
    outs = engine.generate(_prompts(3, seed=5), GREEDY)  # prefill: eager; three decoding: no size fits
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in outs)
    assert sum(step.replays for step in engine.runner.graphs.steps.values()) == before


def test_steps_with_experts_replay_a_step_per_key_set(tiny_llama, plain, expert_packages):
    packages, publisher = expert_packages
    engines = {
        "plain": _engine(tiny_llama, cuda_graphs="off"),
        "graphed": _engine(tiny_llama, cuda_graphs="on"),
    }
    for engine in engines.values():
        for package in packages.values():
            engine.load_expert(package, publisher.trusted)
    prompts = _prompts(4, seed=6)
    experts = [[("lora", 1.0)], [("lora-qv", 0.5), ("ia3", 1.0)], None, [("lora", 0.3), ("lora-qv", 0.7)]]
    outputs = {
        name: [o.token_ids for o in engine.generate(prompts, GREEDY, experts=experts)]
        for name, engine in engines.items()
    }
    assert outputs["graphed"] == outputs["plain"]
    keys = {k for (_, k), step in engines["graphed"].runner.graphs.steps.items() if k and step.replays}
    assert keys and all(("lora", "q_proj") in k and ("ia3", "k_proj:out") in k for k in keys)


def test_pool_growth_captures_the_expert_steps_again():
    generation = [0]
    layouts = []

    def layout_for(size, keys):
        layout = Layout()
        layout.add("input_ids", torch.int64, size)
        layout.add("positions", torch.int64, size)
        layout.add("slot_mapping", torch.int64, size)
        layout.add("query_start_loc", torch.int32, size + 1)
        layout.add("seq_lens", torch.int32, size)
        layouts.append((size, keys))
        return layout

    graphs = DecodeGraphs((1, 2), layout_for, None, torch.device("cpu"), False, lambda: generation[0])
    keys = (("lora", "q_proj"),)
    first = graphs.get(2, keys)
    assert graphs.get(2, keys) is first and graphs.get(2, ()) is graphs.get(2, ())
    generation[0] += 1  # the pools were reallocated
    assert graphs.get(2, keys) is not first
    base = graphs.get(2, ())
    assert graphs.get(2, ()) is base  # steps without experts read no pool


def _small_layout(size, keys):
    layout = Layout()
    layout.add("input_ids", torch.int64, size)
    layout.add("query_start_loc", torch.int32, size + 1)
    layout.add("seq_lens", torch.int32, size)
    layout.add("slot_mapping", torch.int64, size)
    return layout


def test_pool_growth_drops_every_older_expert_step_so_new_key_sets_get_one():
    generation = [0]
    graphs = DecodeGraphs((4,), _small_layout, None, torch.device("cpu"), False, lambda: generation[0])
    key_sets = [(("lora", f"p{i}"),) for i in range(VARIANTS_PER_SIZE + 1)]
    for keys in key_sets[:VARIANTS_PER_SIZE]:
        assert graphs.get(4, keys) is not None
    assert graphs.get(4, key_sets[-1]) is None  # this size holds its quota of key sets
    generation[0] += 1  # the pools grew: the steps above read tensors that are gone
    assert graphs.get(4, key_sets[-1]) is not None
    assert [k for _, k in graphs.steps if k] == [key_sets[-1]]


class _CompileError(Exception):
    """What a Triton compile failure looks like to the caller: not a RuntimeError."""


class _FailingRecorder:
    """Stands in for the CUDA graph recorder (no GPU here): recording the sizes in `failing` raises,
    and the next synchronize raises again, as a CUDA stream does after a failed capture."""

    def __init__(self, failing: set[int]) -> None:
        self.failing, self.broken, self.settled = failing, False, 0

    def record(self, forward):
        logits = forward()
        if logits.shape[0] in self.failing:
            self.broken = True
            raise _CompileError("triton: cannot compile this kernel")
        return object(), logits

    def synchronize(self) -> None:
        if self.broken:
            self.broken = False
            raise RuntimeError("operation not permitted when stream is capturing")

    def settle(self) -> None:
        self.broken = False
        self.settled += 1

    def reserved_bytes(self) -> int:
        return 0


def test_a_capture_that_fails_leaves_its_size_eager_and_the_others_captured(caplog):
    def forward(step, plan):
        return torch.zeros(step.size, 8)

    graphs = DecodeGraphs((1, 2, 4), _small_layout, forward, torch.device("cpu"), False, lambda: 0)
    graphs.capture, graphs.recorder = True, _FailingRecorder(failing={2})
    graphs.capture_all()  # raises nothing: the engine starts
    assert graphs.get(2, ()) is None and (2, ()) in graphs.failed
    assert graphs.get(1, ()).graph is not None and graphs.get(4, ()).graph is not None
    assert graphs.recorder.settled == 1
    assert "decode graph of size 2 (experts ()) not captured: triton: cannot compile" in caplog.text


class _RecordedStep:
    """Stands in for a CUDA graph on the CPU: `replay` runs the captured step's forward again with
    what a capture sees (its region and nothing of the step being replayed) into the output tensor
    the capture produced, as a graph replay writes its captured output."""

    def __init__(self, graphs: DecodeGraphs, step) -> None:
        self.graphs, self.step = graphs, step

    def replay(self) -> None:
        self.step.logits.copy_(self.graphs.forward(self.step, None))


def test_replays_that_see_only_their_region_give_the_eager_tokens(tiny_llama, expert_packages, monkeypatch):
    # A CUDA graph replays what was captured: any input read from the step's Python state instead of
    # the region (a length, an adapter list) would be frozen at capture. With the Triton kernels,
    # which read only device tensors, re-running the captured forward must give the same tokens.
    def capture(self, step) -> bool:
        step.logits = self.forward(step, None)
        step.graph = _RecordedStep(self, step)
        return True

    monkeypatch.setattr(DecodeGraphs, "_capture", capture)
    packages, publisher = expert_packages
    engines = {
        mode: _engine(tiny_llama, kernels="triton", cuda_graphs=mode, max_num_seqs=4)
        for mode in ("off", "on")
    }
    graphs = engines["on"].runner.graphs
    graphs.capture = True  # every step is captured again, and replayed through its recording
    graphs.steps.clear()
    for engine in engines.values():
        for package in packages.values():
            engine.load_expert(package, publisher.trusted)
    prompts = _prompts(3, seed=8)
    experts = [[("lora", 1.0)], None, [("lora-qv", 0.5), ("ia3", 1.0)]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outputs = {
        mode: [o.token_ids for o in engine.generate(prompts, params, experts=experts)]
        for mode, engine in engines.items()
    }
    assert outputs["on"] == outputs["off"]
    replayed = [s for s in graphs.steps.values() if s.replays]
    assert any(s.keys for s in replayed) and all(isinstance(s.graph, _RecordedStep) for s in replayed)
