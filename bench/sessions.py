"""Sessions on the default model through the whole stack, measured in one run.

A conversation of 10 turns whose history reaches about 2,000 tokens; the time to the first token
of its 10th turn (TTFT, at the client), three ways:
1. a session (SessionService): the engine kept the history's KV and computes only the new turn;
2. a stateless request carrying the whole conversation (InferStream), prefix caching on;
3. the same with prefix caching off (a second stack, EXPERT_PREFIX_CACHING=false).
Each is the median over --conversations conversations. Targets: session TTFT <= 1/5 of (3), and
<= (2). Also: the memory an idle session holds (its KV blocks on the engine, its record in Redis).

    python bench/sessions.py --model data/models/SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "sdk/python"))

import grpc  # noqa: E402
import redis  # noqa: E402

from libs.gen.expert.v1 import (  # noqa: E402
    common_pb2,
    engine_pb2,
    engine_pb2_grpc,
    inference_pb2,
    inference_pb2_grpc,
    session_pb2,
    session_pb2_grpc,
)
from services.reception.sessions import session_key  # noqa: E402
from tools.stack import LocalStack  # noqa: E402

TURNS = 10
REPLY_TOKENS = 24
TARGET_VS_NO_CACHE = 1 / 5
TOPICS = ("a lighthouse keeper", "a train timetable", "a bakery", "a chess club", "a river survey")


def user_turn(conversation: int, turn: int) -> str:
    """About 170 tokens of user text, different in every conversation and turn."""
    topic = TOPICS[conversation % len(TOPICS)]
    facts = " ".join(
        f"Note {k}: the {topic} log for day {turn * 10 + k} lists {conversation + k + turn} entries, "
        f"checked by clerk number {(conversation * 7 + k * 3 + turn) % 97}."
        for k in range(6)
    )
    return f"Conversation {conversation}, turn {turn + 1}. {facts} Summarise this in one sentence."


def stack_for(model: Path, root: Path, **env: str) -> LocalStack:
    settings = {
        "EXPERT_MODEL_PATH": str(model),
        "EXPERT_NUM_THREADS": "2",
        "EXPERT_MAX_MODEL_LEN": "4096",
        "EXPERT_LOG_LEVEL": "warning",
        **env,
    }
    stack = LocalStack.on_free_ports(root, env=settings)
    stack.start()
    return stack


def session_ttft(stub, conversation: int) -> tuple[float, str, int]:
    """Run the conversation as a session: the 10th turn's TTFT, the session id and its tokens."""
    sampling = session_pb2.SessionSampling(temperature=0.0, max_new_tokens=REPLY_TOKENS)
    session_id = stub.CreateSession(session_pb2.CreateSessionRequest(sampling=sampling)).session.session_id
    ttft, tokens = 0.0, 0
    for turn in range(TURNS):
        stub.AppendInput(
            session_pb2.AppendInputRequest(session_id=session_id, text=user_turn(conversation, turn))
        )
        started, first = time.perf_counter(), None
        for message in stub.GenerateStream(session_pb2.GenerateStreamRequest(session_id=session_id)):
            if first is None and message.WhichOneof("event") == "text":
                first = time.perf_counter() - started
            if message.HasField("end"):
                tokens = message.end.session.tokens
        ttft = first if first is not None else time.perf_counter() - started
    return ttft, session_id, tokens


def stateless_ttft(stub, conversation: int) -> float:
    """The same conversation resent whole each turn: the 10th turn's TTFT."""
    messages: list[common_pb2.ChatMessage] = []
    ttft = 0.0
    for turn in range(TURNS):
        messages.append(common_pb2.ChatMessage(role="user", content=user_turn(conversation, turn)))
        request = common_pb2.InferenceRequest(messages=messages, temperature=0.0, max_tokens=REPLY_TOKENS)
        started, first, reply = time.perf_counter(), None, ""
        for event in stub.InferStream(inference_pb2.InferStreamRequest(request=request)):
            if first is None and event.WhichOneof("event") == "delta" and event.delta.text:
                first = time.perf_counter() - started
            if event.HasField("result"):
                reply = event.result.text
        ttft = first if first is not None else time.perf_counter() - started
        messages.append(common_pb2.ChatMessage(role="assistant", content=reply))
    return ttft


def idle_memory(stack: LocalStack, session_ids: list[str]) -> tuple[float, float]:
    """KiB of KV an idle session keeps on the engine, and of its record in Redis (means)."""
    with grpc.insecure_channel(stack.target("engine")) as channel:
        stats = engine_pb2_grpc.EngineServiceStub(channel).GetStats(engine_pb2.GetStatsRequest())
    model, load = stats.model, stats.load
    block_bytes = (
        2 * model.num_layers * model.num_kv_heads * model.head_dim * model.dtype_bytes * model.block_size
    )
    kv = load.kv_blocks_sessions * block_bytes / max(1, load.sessions)
    client = redis.Redis.from_url(stack.redis_url)
    record = statistics.mean(client.memory_usage(session_key(s)) or 0 for s in session_ids)
    return kv / 1024, record / 1024


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=REPO / "data/models/SmolLM2-135M-Instruct")
    parser.add_argument("--conversations", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        print("Stack with prefix caching on")
        stack = stack_for(args.model, Path(tmp) / "cached")
        try:
            with grpc.insecure_channel(stack.target("reception")) as channel:
                sessions = session_pb2_grpc.SessionServiceStub(channel)
                inference = inference_pb2_grpc.InferenceServiceStub(channel)
                stateless_ttft(inference, 99)  # warm-up
                runs = [session_ttft(sessions, c) for c in range(args.conversations)]
                session = statistics.median(r[0] for r in runs)
                tokens = statistics.median(r[2] for r in runs)
                kv_kib, record_kib = idle_memory(stack, [r[1] for r in runs])
                cached = statistics.median(
                    stateless_ttft(inference, 100 + c) for c in range(args.conversations)
                )
        finally:
            stack.stop()
        print("Stack with prefix caching off")
        stack = stack_for(args.model, Path(tmp) / "uncached", EXPERT_PREFIX_CACHING="false")
        try:
            with grpc.insecure_channel(stack.target("reception")) as channel:
                inference = inference_pb2_grpc.InferenceServiceStub(channel)
                stateless_ttft(inference, 99)  # warm-up
                uncached = statistics.median(
                    stateless_ttft(inference, 200 + c) for c in range(args.conversations)
                )
        finally:
            stack.stop()

    print(f"\nTurn {TURNS} of a conversation of about {tokens:.0f} tokens (median of {args.conversations}):")
    print(f"  {'way':<44} {'TTFT ms':>8}")
    print(f"  {'session (KV kept on its engine)':<44} {session * 1000:>8.1f}")
    print(f"  {'stateless, whole history, prefix caching on':<44} {cached * 1000:>8.1f}")
    print(f"  {'stateless, whole history, prefix caching off':<44} {uncached * 1000:>8.1f}")
    ratio_off, ratio_on = session / uncached, session / cached
    print(
        f"  session / no-cache: {ratio_off:.3f} (target <= {TARGET_VS_NO_CACHE:.2f}): "
        f"{'PASS' if ratio_off <= TARGET_VS_NO_CACHE else 'short'}"
    )
    print(f"  session / prefix-cache: {ratio_on:.3f} (target <= 1): {'PASS' if ratio_on <= 1 else 'short'}")
    print(f"Idle session: {kv_kib:.0f} KiB of KV on its engine, {record_kib:.1f} KiB of record in Redis")


if __name__ == "__main__":
    main()
