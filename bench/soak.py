"""A bounded soak of the whole stack: mixed traffic for N minutes, then a check that nothing leaked.

An open-loop load (Poisson arrivals at `--rate` jobs/s, seeded) runs for `--minutes` against
reception, each job one of eight kinds drawn with fixed weights: a sync `infer`, a `stream`
(every chunk consumed), an async `submit` followed by `get_job` polls, a `cancel` (submit, then
cancel after a short random delay), a `timeout` (a small `timeout_ms`, so that it usually ends
TIMED_OUT), a `session` (created, two turns, ended), a `regex` and a `json` job (a sync infer
constrained by a regex or a JSON schema, drawn from FORMATS of each: a client population's fixed
formats, which the engine's grammar cache holds once warm). Jobs run concurrently, so a slow one
never delays the next arrival. After the load, a bounded drain waits for every job to become
final; then it prints:

- jobs by final state (each job's status read back with GetJob), per kind, with time per kind
  and per stage (a queue wait far above the inference time means the load is over capacity);
- jobs not final at the end (target 0), counting the jobs found in Redis whose id the client
  never got (an Infer call still open when the drain ended), and client errors by gRPC code;
- RSS per service (and redis-server) at 1, 5 and 10 minutes into the load and at its end, and its
  growth after the first minute (target under 5 %, bench/soak_memory.py);
- Redis `used_memory` at the start and the end, and its growth per job;
- KV blocks in use on each engine at the end (target 0) and the reservations preparation still
  holds (target 0).

The exit status is 0 when no job is left non-final, no service grew by 5 % or more after the
first minute, and the KV (blocks and reservations) is back to 0, else 1.

The model is the default one (SmolLM2-135M-Instruct): a tiny generated model would hide what
grows with a real 49k-token vocabulary (the tokenizer, the grammars compiled for it) and with
real weights (the allocator's arenas under real tensors).

    python bench/soak.py --minutes 10 --rate 1 --max-tokens 16 64 --seed 0 --json
    python bench/soak.py --target 127.0.0.1:50051 --preparation 127.0.0.1:50053 \\
        --redis-url redis://127.0.0.1:6379/0   # an already running stack (RSS: n/a)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from soak_memory import RssSampler, growth, growth_ok, print_rss, rss_by_service

from expert_system import (
    AsyncExpertClient,
    AsyncInferStream,
    ExpertClient,
    ExpertSystemError,
    InferenceResult,
)
from expert_system.results import FINAL_STATUSES
from libs.gen.expert.v1 import engine_pb2, engine_pb2_grpc, preparation_pb2, preparation_pb2_grpc
from services.reception.jobs import PREFIX as JOB_PREFIX
from tools.stack import REDIS, SERVICES, LocalStack

# Kind -> weight. Mostly plain traffic; cancels and timeouts are the paths that leak when wrong.
KINDS = {
    "sync": 0.25,
    "stream": 0.18,
    "async": 0.10,
    "cancel": 0.08,
    "timeout": 0.07,
    "session": 0.12,
    "regex": 0.10,
    "json": 0.10,
}
FORMATS = 16  # distinct regexes, and distinct JSON schemas, the constrained kinds draw from
TIMEOUT_MS = (20, 250)  # the `timeout` kind: well below one job's run time
CANCEL_AFTER_S = (0.0, 1.0)  # the `cancel` kind: sometimes queued, sometimes running
POLL_S = 0.25  # get_job polling interval
# A client-side bound on any one job, so that the soak itself always ends.
JOB_DEADLINE_S = 300.0
PROGRESS_EVERY_S = 15.0
SETTLE_S = 10.0  # after the drain, for the KV to come back (a release may trail the final status)

PROMPTS = [
    "What is the capital of France?",
    "Name three primary colours.",
    "Write one sentence about the sea.",
    "How many legs does a spider have?",
    "Give me a synonym for happy.",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
    "Suggest a name for a cat.",
    "List two fruits that are red.",
    "Who wrote Romeo and Juliet?",
    "Describe a tree in five words.",
    "Tell me a fact about the moon.",
]


@dataclass
class Params:
    """What one job asks for, drawn from the seeded generator at its arrival."""

    prompt: str
    max_tokens: int
    seed: int
    timeout_ms: int
    cancel_after_s: float
    format_index: int = 0  # which of the FORMATS a constrained kind uses


@dataclass
class JobRecord:
    index: int
    kind: str
    params: Params
    job_id: str | None = None
    client_status: str | None = None  # what the call (or the last poll) reported
    error: str | None = None  # the gRPC code name (or exception type) when a call raised
    final_status: str | None = None  # GetJob's answer after the drain
    seconds: float | None = None  # the whole call (or submit to final)
    tokens: int = 0  # generated, as the result says
    stages_ms: dict[str, float] | None = None  # the result's InferenceMetrics, by stage
    # A stream's id arrives before its first chunk: kept here so that the drain can follow it.
    stream: AsyncInferStream | None = field(default=None, repr=False)

    def known_id(self) -> str | None:
        if self.job_id is None and self.stream is not None:
            self.job_id = self.stream.job_id
        return self.job_id


# --- load ------------------------------------------------------------------------------------------


def request_fields(p: Params) -> dict[str, Any]:
    # Sampled, not greedy: answers vary in length, as real traffic does, yet repeat with the seed.
    return {"max_tokens": p.max_tokens, "temperature": 0.7, "seed": p.seed}


def record_result(job: JobRecord, result: InferenceResult) -> None:
    job.job_id, job.client_status = result.job_id, result.status
    job.tokens = result.tokens_generated
    m = result.metrics
    if m is not None:
        job.stages_ms = {
            "queue": m.queue_latency_ms,
            "router": m.router_latency_ms,
            "preparation": m.expert_load_latency_ms,
            "ttft": m.ttft_ms,
            "inference": m.inference_latency_ms,
            "postproc": m.postproc_latency_ms,
        }


async def poll_until_final(client: AsyncExpertClient, job: JobRecord) -> None:
    deadline = time.monotonic() + JOB_DEADLINE_S
    while time.monotonic() < deadline:
        found = await client.get_job(job.job_id)
        job.client_status = found.status
        if found.is_finished:
            if found.result is not None:
                record_result(job, found.result)
            return
        await asyncio.sleep(POLL_S)


async def run_sync(client: AsyncExpertClient, job: JobRecord) -> None:
    record_result(
        job, await client.infer(job.params.prompt, timeout=JOB_DEADLINE_S, **request_fields(job.params))
    )


async def run_stream(client: AsyncExpertClient, job: JobRecord) -> None:
    stream = job.stream = client.infer_stream(
        job.params.prompt, timeout=JOB_DEADLINE_S, **request_fields(job.params)
    )
    try:
        async for _ in stream:
            pass
    finally:
        job.known_id()
    if stream.result is not None:
        record_result(job, stream.result)


async def run_async(client: AsyncExpertClient, job: JobRecord) -> None:
    job.job_id = (await client.submit(job.params.prompt, **request_fields(job.params))).job_id
    await poll_until_final(client, job)


async def run_cancel(client: AsyncExpertClient, job: JobRecord) -> None:
    job.job_id = (await client.submit(job.params.prompt, **request_fields(job.params))).job_id
    await asyncio.sleep(job.params.cancel_after_s)
    await client.cancel(job.job_id)
    # CancelJob asks a running job to stop; it is final only once its dispatcher saw the request.
    await poll_until_final(client, job)


async def run_timeout(client: AsyncExpertClient, job: JobRecord) -> None:
    fields = request_fields(job.params) | {"timeout_ms": job.params.timeout_ms}
    record_result(job, await client.infer(job.params.prompt, timeout=JOB_DEADLINE_S, **fields))


def regex_format(index: int) -> str:
    return rf"(Yes|No), because [a-z ]{{1,{20 + index}}}\."


def json_format(index: int) -> dict[str, Any]:
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "maxLength": 20 + index}, "score": {"type": "integer"}},
        "required": ["answer", "score"],
    }
    return {"type": "json_schema", "json_schema": {"name": f"answer{index}", "schema": schema}}


async def run_regex(client: AsyncExpertClient, job: JobRecord) -> None:
    fields = request_fields(job.params) | {"regex": regex_format(job.params.format_index)}
    record_result(job, await client.infer(job.params.prompt, timeout=JOB_DEADLINE_S, **fields))


async def run_json(client: AsyncExpertClient, job: JobRecord) -> None:
    fields = request_fields(job.params) | {"response_format": json_format(job.params.format_index)}
    record_result(job, await client.infer(job.params.prompt, timeout=JOB_DEADLINE_S, **fields))


async def run_session(client: AsyncExpertClient, job: JobRecord) -> None:
    """A conversation of two turns, then ended; the job followed is the turn running (its id comes
    with the turn's end; a turn cut off before is found in Redis among the untracked jobs)."""
    p = job.params
    async with client.session(max_new_tokens=p.max_tokens, temperature=0.7, seed=p.seed) as session:
        for text in (p.prompt, "Say it again in other words."):
            await session.append(text)
            stream = session.generate(timeout=JOB_DEADLINE_S)
            async for _ in stream:
                pass
            end = stream.end
            job.job_id, job.client_status = end.job_id, None
            job.tokens += len(end.text.split())
            await poll_until_final(client, job)


RUNNERS: dict[str, Callable[[AsyncExpertClient, JobRecord], Awaitable[None]]] = {
    "sync": run_sync,
    "stream": run_stream,
    "async": run_async,
    "cancel": run_cancel,
    "timeout": run_timeout,
    "session": run_session,
    "regex": run_regex,
    "json": run_json,
}


async def run_job(client: AsyncExpertClient, job: JobRecord) -> None:
    """One job; whatever it raises is recorded, never propagated (the soak goes on)."""
    began = time.monotonic()
    try:
        await RUNNERS[job.kind](client, job)
    except ExpertSystemError as exc:
        job.error = exc.code
    except asyncio.CancelledError:
        job.error = "ABANDONED"  # still running when the drain ended
        raise
    except Exception as exc:
        job.error = type(exc).__name__
    finally:
        job.seconds = time.monotonic() - began


def draw_job(rng: random.Random, index: int, max_tokens: tuple[int, int]) -> JobRecord:
    kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
    params = Params(
        prompt=rng.choice(PROMPTS),
        max_tokens=rng.randint(*max_tokens),
        seed=rng.randrange(2**32),
        timeout_ms=rng.randint(*TIMEOUT_MS),
        cancel_after_s=rng.uniform(*CANCEL_AFTER_S),
        format_index=rng.randrange(FORMATS),
    )
    return JobRecord(index, kind, params)


def progress(began: float, jobs: list[JobRecord], tasks: set[asyncio.Task]) -> None:
    running = sum(not t.done() for t in tasks)
    errors = sum(j.error is not None for j in jobs)
    print(
        f"  t={time.monotonic() - began:5.0f} s  arrived {len(jobs)}  in flight {running}  errors {errors}",
        file=sys.stderr,
        flush=True,
    )


async def offer_load(
    client: AsyncExpertClient, args: argparse.Namespace
) -> tuple[list[JobRecord], set[asyncio.Task]]:
    """Open loop: arrivals follow the Poisson clock, however far behind the stack falls."""
    rng = random.Random(args.seed)
    jobs: list[JobRecord] = []
    tasks: set[asyncio.Task] = set()
    began = time.monotonic()
    next_at, next_report = began, began + PROGRESS_EVERY_S
    while True:
        next_at += rng.expovariate(args.rate)
        if next_at >= began + args.minutes * 60:
            break
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        job = draw_job(rng, len(jobs), tuple(args.max_tokens))
        jobs.append(job)
        tasks.add(asyncio.create_task(run_job(client, job)))
        if time.monotonic() >= next_report:
            progress(began, jobs, tasks)
            next_report += PROGRESS_EVERY_S
    progress(began, jobs, tasks)
    return jobs, tasks


async def read_final_statuses(client: AsyncExpertClient, jobs: list[JobRecord], deadline: float) -> None:
    """GetJob on every job until all are final or the deadline passes (one pass at least)."""
    while True:
        pending = [j for j in jobs if j.known_id() and j.final_status not in FINAL_STATUSES]
        for job in pending:
            try:
                job.final_status = (await client.get_job(job.known_id())).status
            except ExpertSystemError as exc:
                job.final_status = f"GetJob {exc.code}"
        if not any(j.final_status not in FINAL_STATUSES for j in pending) or time.monotonic() >= deadline:
            return
        await asyncio.sleep(1.0)


async def untracked_jobs(
    client: AsyncExpertClient, redis_url: str | None, before: set[str], jobs: list[JobRecord], deadline: float
) -> list[JobRecord] | None:
    """Jobs reception created during the soak whose id the client never got (an Infer call still
    open when the drain ended), found in Redis, with their status read through GetJob."""
    if redis_url is None:
        return None
    known = {j.known_id() for j in jobs}
    unseen = [
        JobRecord(-1, "untracked", Params("", 0, 0, 0, 0.0), job_id=job_id)
        for job_id in sorted(await asyncio.to_thread(job_ids_in_redis, redis_url) - before - known)
    ]
    await read_final_statuses(client, unseen, deadline)
    return unseen


async def soak(
    args: argparse.Namespace, target: str, redis_url: str | None, before: set[str], sampler: RssSampler
) -> tuple[list[JobRecord], list[JobRecord] | None]:
    async with AsyncExpertClient(target) as client:
        sampler.start()
        jobs, tasks = await offer_load(client, args)
        await asyncio.to_thread(sampler.stop)  # the RSS figures are the load's, not the drain's
        deadline = time.monotonic() + args.drain
        # Most jobs end with their own call; what is left is then asked for by id.
        if tasks:
            await asyncio.wait(tasks, timeout=max(0.0, deadline - time.monotonic()))
        await read_final_statuses(client, jobs, deadline)
        untracked = await untracked_jobs(client, redis_url, before, jobs, deadline)
        # The snapshot is taken: calls still open are abandoned now (which cancels their jobs).
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return jobs, untracked


# --- resources -------------------------------------------------------------------------------------


def job_ids_in_redis(url: str | None) -> set[str]:
    """The ids of the job records in Redis. Reception's key layout (services/reception/jobs.py):
    `expert:job:{id}` is the record, `expert:job:{id}:<part>` its text, events and result."""
    if url is None:
        return set()
    import redis

    with redis.Redis.from_url(url, decode_responses=True) as r:
        keys = r.scan_iter(match=f"{JOB_PREFIX}*", count=1000)
        return {key.removeprefix(JOB_PREFIX) for key in keys if ":" not in key.removeprefix(JOB_PREFIX)}


def redis_memory(url: str | None) -> dict[str, int] | None:
    if url is None:
        return None
    import redis

    with redis.Redis.from_url(url) as r:
        return {"used_memory": int(r.info("memory")["used_memory"]), "keys": int(r.dbsize())}


def kv_usage(preparation: str | None) -> list[dict[str, Any]] | None:
    """Per engine: KV blocks in use now (the engine's own GetStats, not the last heartbeat) and the
    reservations preparation holds for placed jobs. A failed call is an entry with an `error`."""
    if preparation is None:
        return None
    try:
        with grpc.insecure_channel(preparation) as channel:
            stub = preparation_pb2_grpc.PreparationServiceStub(channel)
            engines = stub.ListEngines(preparation_pb2.ListEnginesRequest(), timeout=10).engines
    except grpc.RpcError as exc:
        return [{"engine": "?", "error": f"ListEngines {exc.code().name}"}]
    return [engine_kv(engine) for engine in engines]


def engine_kv(engine: Any) -> dict[str, Any]:
    entry: dict[str, Any] = {"engine": engine.engine_id, "reservations": engine.active_jobs}
    try:
        with grpc.insecure_channel(engine.address) as channel:
            stub = engine_pb2_grpc.EngineServiceStub(channel)
            load = stub.GetStats(engine_pb2.GetStatsRequest(), timeout=10).load
    except grpc.RpcError as exc:
        return entry | {"error": f"GetStats {exc.code().name}"}
    return entry | {
        "kv_used": load.kv_blocks_used,
        "kv_total": load.kv_blocks_total,
        "running": load.running,
        "waiting": load.waiting,
    }


def kv_idle(usage: list[dict[str, Any]] | None) -> bool:
    """Every engine answered with no KV block in use and no reservation (no engine: not idle, as
    nothing could be checked)."""
    return bool(usage) and all(
        "error" not in e and e["kv_used"] == 0 and e["reservations"] == 0 for e in usage
    )


def settle_kv(preparation: str | None, seconds: float) -> list[dict[str, Any]] | None:
    """The KV usage once idle, or as it is after `seconds` (a release may trail the final status)."""
    deadline = time.monotonic() + seconds
    usage = kv_usage(preparation)
    while usage is not None and not kv_idle(usage) and time.monotonic() < deadline:
        time.sleep(0.5)
        usage = kv_usage(preparation)
    return usage


# --- the stack -------------------------------------------------------------------------------------


def stack_env(model: str, threads: int, max_num_seqs: int) -> dict[str, str]:
    return {
        "EXPERT_MODEL_PATH": str(Path(model).resolve()),
        "EXPERT_NUM_THREADS": str(threads),
        "EXPERT_MAX_MODEL_LEN": "1024",
        "EXPERT_MAX_NUM_SEQS": str(max_num_seqs),
        "EXPERT_KV_NUM_BLOCKS": "512",
        "EXPERT_LOG_LEVEL": "info",
    }


def warm_up(target: str) -> None:
    """One job down every path the load takes, so that what each service builds on first use (the
    channels, the router's first plan, the engine's first batch, the structured-output machinery in
    the engine and postproc, a session's turn) is in place before the RSS clock starts."""
    with ExpertClient(target) as client:
        client.infer(PROMPTS[0], max_tokens=8, timeout=JOB_DEADLINE_S)
        for _ in client.infer_stream(PROMPTS[1], max_tokens=8, timeout=JOB_DEADLINE_S):
            pass
        client.infer(PROMPTS[2], max_tokens=16, regex=regex_format(0), timeout=JOB_DEADLINE_S)
        client.infer(PROMPTS[3], max_tokens=16, response_format=json_format(0), timeout=JOB_DEADLINE_S)
        with client.session(max_new_tokens=8) as session:
            session.append(PROMPTS[4])
            for _ in session.generate(timeout=JOB_DEADLINE_S):
                pass


def stack_pids(stack: LocalStack) -> dict[str, int]:
    return {name: process.pid for name, process in stack.supervised().items()}


def dead_services(stack: LocalStack) -> dict[str, int]:
    return {name: p.returncode for name, p in stack.processes.items() if p.poll() is not None}


def log_problems(log_dir: Path, limit: int = 5) -> dict[str, dict[str, Any]]:
    """Per service log: warning/error lines counted, with the most frequent events."""
    problems: dict[str, dict[str, Any]] = {}
    for path in sorted(log_dir.glob("*.log")):
        levels: Counter[str] = Counter()
        events: Counter[str] = Counter()
        for line in path.read_text(errors="replace").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                if "Traceback" in line or "Error" in line:
                    levels["raw"] += 1
                    events[line.strip()[:160]] += 1
                continue
            level = str(record.get("level", ""))
            if level in ("warning", "error", "critical"):
                levels[level] += 1
                events[f"{level}: {str(record.get('event', ''))[:160]}"] += 1
        if levels:
            problems[path.stem] = {"levels": dict(levels), "top": events.most_common(limit)}
    return problems


# --- the report ------------------------------------------------------------------------------------


def state_of(job: JobRecord) -> str:
    if job.job_id is None:
        return f"no job id ({job.error})"
    return job.final_status or "unknown"


def print_states(jobs: list[JobRecord]) -> None:
    states = Counter(state_of(j) for j in jobs)
    by_kind = Counter((state_of(j), j.kind) for j in jobs)
    print(f"\njobs by final state ({len(jobs)} jobs)")
    print(f"{'state':<28}" + "".join(f"{k:>9}" for k in KINDS) + f"{'total':>9}")
    for state, total in states.most_common():
        print(f"{state:<28}" + "".join(f"{by_kind[state, k]:>9}" for k in KINDS) + f"{total:>9}")
    print(f"{'all':<28}" + "".join(f"{sum(j.kind == k for j in jobs):>9}" for k in KINDS) + f"{len(jobs):>9}")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def print_latency(jobs: list[JobRecord], seconds: float) -> None:
    """Time per job by kind: the call, or submit to final for async and cancel."""
    print(f"\n{'kind':<10}{'p50 s':>9}{'p99 s':>9}{'max s':>9}{'tokens':>9}")
    for kind in KINDS:
        mine = [j for j in jobs if j.kind == kind]
        times = [j.seconds for j in mine if j.seconds is not None]
        if times:
            print(
                f"{kind:<10}{percentile(times, 50):>9.2f}{percentile(times, 99):>9.2f}{max(times):>9.2f}"
                f"{sum(j.tokens for j in mine):>9}"
            )
    tokens = sum(j.tokens for j in jobs)
    print(f"generated {tokens} tokens in {seconds:.0f} s (load and drain): {tokens / seconds:.1f} tokens/s")


def print_stages(jobs: list[JobRecord]) -> None:
    """Where completed jobs spent their time: a queue wait far above inference means the stack
    fell behind the arrivals (the soak is then over capacity, not only long)."""
    done = [j.stages_ms for j in jobs if j.final_status == "completed" and j.stages_ms]
    if not done:
        return
    print(f"\n{'stage (completed)':<20}{'p50 ms':>10}{'p99 ms':>10}")
    for stage in done[0]:
        values = [d[stage] for d in done]
        print(f"{stage:<20}{percentile(values, 50):>10.1f}{percentile(values, 99):>10.1f}")


def print_untracked(untracked: list[JobRecord] | None) -> None:
    if untracked is None:
        print("jobs in Redis whose id the client never got: n/a (no --redis-url)")
        return
    states = Counter(j.final_status for j in untracked)
    print(
        f"jobs in Redis whose id the client never got (Infer calls still open after the drain): "
        f"{len(untracked)}{', ' if states else ''}{', '.join(f'{s} {n}' for s, n in states.items())}"
    )


def print_errors(jobs: list[JobRecord]) -> None:
    errors = Counter((j.kind, j.error) for j in jobs if j.error)
    print(f"\nclient errors: {sum(errors.values())}")
    for (kind, code), count in errors.most_common():
        print(f"  {kind:<10}{code:<24}{count:>6}")
    # The call's own answer and GetJob's should agree once both are final.
    disagree = [
        j
        for j in jobs
        if j.client_status in FINAL_STATUSES
        and j.final_status in FINAL_STATUSES
        and j.client_status != j.final_status
    ]
    if disagree:
        print(f"  call vs GetJob disagree on {len(disagree)} jobs, e.g. {disagree[0].job_id}")


def print_redis(start: dict[str, int] | None, end: dict[str, int] | None, jobs: int) -> None:
    if start is None or end is None:
        print("\nRedis memory: n/a (no --redis-url)")
        return
    growth = end["used_memory"] - start["used_memory"]
    per_job = growth / jobs if jobs else 0.0
    print(
        f"\nRedis used_memory: start {start['used_memory'] / 2**20:.2f} MiB ({start['keys']} keys), "
        f"end {end['used_memory'] / 2**20:.2f} MiB ({end['keys']} keys); "
        f"growth {growth / 2**20:+.2f} MiB over {jobs} jobs = {per_job / 1024:.1f} KiB per job"
    )


def print_kv(usage: list[dict[str, Any]] | None) -> None:
    if usage is None:
        print("\nKV at the end: n/a (no --preparation)")
        return
    print("\nKV at the end (target: 0 blocks used, 0 reservations)")
    for e in usage:
        if "error" in e:
            print(f"  {e['engine']}: {e['error']}")
            continue
        print(
            f"  {e['engine']}: {e['kv_used']}/{e['kv_total']} blocks used, running {e['running']}, "
            f"waiting {e['waiting']}, reservations in preparation {e['reservations']}"
        )
    if not usage:
        print("  no engine registered")


def print_logs(problems: dict[str, dict[str, Any]], log_dir: Path) -> None:
    print(f"\nwarnings and errors in the service logs ({log_dir})")
    if not problems:
        print("  none")
    for name, found in problems.items():
        print(f"  {name}: {found['levels']}")
        for event, count in found["top"]:
            print(f"    {count:>5}  {event}")


# --- main ------------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="data/models/SmolLM2-135M-Instruct")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--rate", type=float, default=1.0, help="arrivals per second (Poisson)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--max-tokens", type=int, nargs=2, default=[16, 64], metavar=("MIN", "MAX"), help="per job"
    )
    parser.add_argument("--drain", type=float, default=60.0, help="seconds allowed for jobs to end")
    parser.add_argument("--threads", type=int, default=2, help="engine threads")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--log-dir", help="where the stack's logs go (default: a new temporary directory)")
    parser.add_argument("--json", action="store_true", help="also print a JSON summary (last line)")
    parser.add_argument("--target", help="soak a running stack's reception (host:port) instead")
    parser.add_argument("--preparation", help="with --target: preparation's host:port, for the KV")
    parser.add_argument(
        "--redis-url",
        help="with --target: its Redis, for the memory figures and the jobs whose id the client never "
        "got (on a shared stack these include other clients' jobs)",
    )
    return parser.parse_args()


@dataclass
class Snapshot:
    rss: dict[str, int | None]
    redis: dict[str, int] | None


def measure_and_soak(
    args: argparse.Namespace, reception: str, preparation: str | None, redis_url: str | None, pids: dict
) -> dict[str, Any]:
    warm_up(reception)
    start = Snapshot(rss_by_service(pids), redis_memory(redis_url))
    began = time.monotonic()
    before = job_ids_in_redis(redis_url)  # the warm-up's
    sampler = RssSampler(pids)
    jobs, untracked = asyncio.run(soak(args, reception, redis_url, before, sampler))
    seconds = time.monotonic() - began
    kv = settle_kv(preparation, SETTLE_S)
    end = Snapshot(rss_by_service(pids), redis_memory(redis_url))
    marks = sampler.marks(args.minutes * 60)
    return {
        "rss": marks,
        "growth": growth(marks),
        "jobs": jobs,
        "untracked": untracked,
        "later": statuses_now(reception, [j.job_id for j in non_final(jobs, untracked)]),
        "start": start,
        "end": end,
        "kv": kv,
        "seconds": seconds,
    }


def non_final(jobs: list[JobRecord], untracked: list[JobRecord] | None) -> list[JobRecord]:
    with_id = [j for j in jobs if j.job_id is not None] + (untracked or [])
    return [j for j in with_id if j.final_status not in FINAL_STATUSES]


def statuses_now(target: str, job_ids: list[str]) -> dict[str, str]:
    """The jobs left non-final, read again after the KV check (up to SETTLE_S later): a slow job
    may have ended by then; one still not final while the engines are idle is stuck."""
    statuses = {}
    with ExpertClient(target) as client:
        for job_id in job_ids:
            try:
                statuses[job_id] = client.get_job(job_id).status
            except ExpertSystemError as exc:
                statuses[job_id] = f"GetJob {exc.code}"
    return statuses


def report(args: argparse.Namespace, run: dict[str, Any], log_dir: Path | None, dead: dict) -> bool:
    jobs: list[JobRecord] = run["jobs"]
    print(
        f"\nsoak: {args.minutes:g} min at {args.rate:g} jobs/s (Poisson, seed {args.seed}), "
        f"{len(jobs)} jobs, mix {', '.join(f'{k} {w:.0%}' for k, w in KINDS.items())}; "
        f"{run['seconds']:.0f} s with the drain"
    )
    print_states(jobs)
    untracked: list[JobRecord] | None = run["untracked"]
    print_untracked(untracked)
    print_latency(jobs, run["seconds"])
    print_stages(jobs)
    not_final = non_final(jobs, untracked)
    print(f"\njobs not final at the end: {len(not_final)} (target 0)   {'PASS' if not not_final else 'FAIL'}")
    for job in not_final[:10]:
        print(
            f"  {job.job_id}  {job.kind:<9} {job.final_status}  call: {job.client_status or job.error}"
            f"  re-read after the KV check: {run['later'].get(job.job_id)}"
        )
    print_errors(jobs)
    submitted = len(jobs) + len(untracked or [])
    print(f"\njobs submitted {submitted}, final {submitted - len(not_final)}")
    print_rss(run["rss"], run["growth"], [*SERVICES, REDIS])
    memory_ok = not run["rss"] or growth_ok(run["growth"], exempt=REDIS)
    print(
        f"RSS growth after the first minute under 5 % (redis-server excepted: it keeps the jobs): "
        f"{'n/a' if not run['rss'] else 'PASS' if memory_ok else 'FAIL'}"
    )
    print_redis(
        run["start"].redis, run["end"].redis, sum(j.job_id is not None for j in jobs) + len(untracked or [])
    )
    print_kv(run["kv"])
    kv_ok = run["kv"] is None or kv_idle(run["kv"])
    print(f"KV back to 0: {'n/a' if run['kv'] is None else 'PASS' if kv_ok else 'FAIL'}")
    if dead:
        print(f"\nservices that exited during the soak (status): {dead}")
    if log_dir is not None:
        print_logs(log_problems(log_dir), log_dir)
    ok = not not_final and kv_ok and memory_ok and not dead
    print(f"\n{'PASS' if ok else 'FAIL'}")
    if args.json:
        print(json.dumps(summary(args, run, not_final, ok)))
    return ok


def summary(args: argparse.Namespace, run: dict[str, Any], not_final: list[JobRecord], ok: bool) -> dict:
    jobs: list[JobRecord] = run["jobs"]
    return {
        "minutes": args.minutes,
        "rate": args.rate,
        "seed": args.seed,
        "jobs": len(jobs),
        "by_state": dict(Counter(state_of(j) for j in jobs)),
        "by_kind_state": {
            f"{k}/{s}": n for (k, s), n in Counter((j.kind, state_of(j)) for j in jobs).items()
        },
        "untracked": None
        if run["untracked"] is None
        else dict(Counter(j.final_status for j in run["untracked"])),
        "not_final": {j.job_id: j.final_status for j in not_final},
        "not_final_later": run["later"],
        "errors": {
            f"{k}/{e}": n for (k, e), n in Counter((j.kind, j.error) for j in jobs if j.error).items()
        },
        "rss_kib": run["rss"],
        "rss_growth_after_1_min": run["growth"],
        "redis": {"start": run["start"].redis, "end": run["end"].redis},
        "kv": run["kv"],
        "pass": ok,
    }


def main() -> int:
    args = parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.target:
        run = measure_and_soak(args, args.target, args.preparation, args.redis_url, {})
        return 0 if report(args, run, None, {}) else 1

    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="bench-soak-"))
    env = stack_env(args.model, args.threads, args.max_num_seqs)
    stack = LocalStack.on_free_ports(log_dir, env=env)
    print(f"starting the stack (logs in {log_dir})", file=sys.stderr, flush=True)
    stack.start(timeout=600)
    try:
        run = measure_and_soak(
            args, stack.target("reception"), stack.target("preparation"), stack.redis_url, stack_pids(stack)
        )
        dead = dead_services(stack)
    finally:
        stack.stop()
    return 0 if report(args, run, log_dir, dead) else 1


if __name__ == "__main__":
    sys.exit(main())
