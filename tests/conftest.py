"""Shared fixtures: tiny generated checkpoints, the default model, and engines built on them."""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import pytest
import torch

# Nothing in the tests may reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(min(2, os.cpu_count() or 1))
# Without a GPU the Triton kernels run on CPU tensors in Triton's interpreter. Triton reads this when
# a kernel is defined (at import), so it is set before any test module imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# grpc.aio shuts its process-wide completion queue down whenever the last aio object is collected,
# and that shutdown can wait forever on its poller thread (grpc/grpc#40989, #22365). The services
# keep aio objects for their whole life; this process creates and drops hundreds across event
# loops, and twice a full run hung in a garbage collection doing that shutdown. One reference held
# for the session keeps the queue up.
grpc.aio.init_grpc_aio()

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = REPO / "data" / "models" / "SmolLM2-135M-Instruct"


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny random Llama, Qwen2 and Qwen3 checkpoint (weights saved by transformers)."""
    from tests.helpers.tiny_checkpoint import ARCHITECTURES, write_checkpoint

    root = tmp_path_factory.mktemp("tiny")
    return {arch: write_checkpoint(root / arch, arch, seed=i) for i, arch in enumerate(ARCHITECTURES)}


@pytest.fixture(scope="session")
def tiny_llama(tiny_checkpoints: dict[str, Path]) -> Path:
    return tiny_checkpoints["llama"]


@pytest.fixture(scope="session")
def expert_packages(tiny_llama, tmp_path_factory):
    """Three signed expert packages for the tiny Llama (a LoRA on every projection, a LoRA on q and
    v, an IA³) and their publisher."""
    from tests.helpers.experts import Publisher
    from tests.helpers.peft_adapters import write_ia3_adapter, write_lora_adapter

    root = tmp_path_factory.mktemp("tiny-experts")
    publisher = Publisher.create(root / "publisher")
    packages = {
        "lora": write_lora_adapter(tiny_llama, root / "lora", seed=1),
        "lora-qv": write_lora_adapter(
            tiny_llama, root / "lora-qv", target_modules=("q_proj", "v_proj"), seed=2
        ),
        "ia3": write_ia3_adapter(tiny_llama, root / "ia3", seed=3),
    }
    return {n: publisher.pack(d, tiny_llama, root / f"{n}.expert", n) for n, d in packages.items()}, publisher


@pytest.fixture(scope="session")
def shared_tiny_stack(tiny_llama, tmp_path_factory):
    """One ready stack on the tiny model with the default settings (tests/e2e/conftest.py's
    TINY_SETTINGS), started once for every module whose tests only send it requests: a stack costs
    five service start-ups and a model load. A module whose tests kill, restart or reconfigure a
    service, or count what its stack did since it started, takes a stack of its own."""
    from tests.e2e.conftest import ready_tiny_stack

    with ready_tiny_stack(tiny_llama, tmp_path_factory.mktemp("shared-stack")) as stack:
        yield stack


@pytest.fixture(scope="session")
def default_model() -> Path:
    """The default SmolLM2 model converted by `make model`."""
    if not (DEFAULT_MODEL / "config.json").is_file():
        pytest.skip(f"default model missing at {DEFAULT_MODEL}: run `make model`")
    return DEFAULT_MODEL


@pytest.fixture(scope="session")
def redis_url():
    """The URL of a real redis-server started for this test session (no persistence)."""
    from tests.helpers.redis_server import redis_server

    with redis_server() as url:
        yield url


@pytest.fixture
def clean_redis_url(redis_url: str) -> str:
    """`redis_url`, emptied before the test."""
    from tests.helpers.redis_server import flush

    flush(redis_url)
    return redis_url


@pytest.fixture
def expert_stats(clean_redis_url: str):
    """The router's feedback statistics on an emptied real Redis, prior 0.5."""
    import redis

    from services.router.stats import ExpertStats

    client = redis.Redis.from_url(clean_redis_url)
    yield ExpertStats(client, prior=0.5)
    client.close()


LONG = 1000  # tokens: about a second on the tiny model (its max_model_len is 1024)


@pytest.fixture(scope="session")
def long_prompt(tiny_llama) -> str:
    """A raw prompt whose greedy continuation runs LONG tokens without an end-of-sequence token
    (found once per session: the tiny model is the session's, and the search loads an engine)."""
    from libs.engine import LLMEngine, SamplingParams  # after TRITON_INTERPRET is set (above)

    engine = LLMEngine.from_pretrained(str(tiny_llama), max_model_len=1024, num_blocks=160)
    for candidate in (
        "Once upon a time",
        "def add(a, b):",
        "SELECT name FROM",
        "The quick brown fox",
        "Hello",
    ):
        out = engine.generate(
            [candidate], SamplingParams(temperature=0.0, max_tokens=LONG, repetition_penalty=1.0)
        )
        if out[0].finish_reason == "length":
            return candidate
    pytest.fail("no candidate prompt runs to max_tokens on the tiny model")
