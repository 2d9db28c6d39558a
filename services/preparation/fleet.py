"""The engine fleet as preparation sees it: registered engines, their load, the jobs placed on them.

Engines register on start and heartbeat with their load; one that misses heartbeats for longer than
the timeout is dropped, and the jobs placed on it are forgotten (their dispatchers see the engine's
stream fail and fail over). One that a call finds unreachable (preparation's own, or a dispatcher's
stream that broke, named in its next Prepare) is dropped at once, the same way. Each placed job
holds one of its engine's sequence slots and a KV reservation until it is released.

Each engine also reports the experts it holds (with every heartbeat, and in the answer to each load
or unload preparation makes). A report carries the engine's change counter, so one taken before a
change preparation already knows of is ignored. A placed job counts as a reference to each of its
experts on its engine; an expert no job references may be unloaded to make room, least recently
used first.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from libs.gen.expert.v1 import common_pb2


def expert_key(name: str, version: str) -> str:
    return f"{name}@{version}"


@dataclass(frozen=True)
class FleetCapacity:
    free_slots: int  # sequences the engines can still take
    kv_blocks_free: int


@dataclass
class PlacedJob:
    job_id: str
    engine_id: str
    kv_blocks: int
    placed_at: float
    experts: tuple[str, ...] = ()  # expert_key of each expert the job uses there (unload protection)


@dataclass
class Engine:
    info: common_pb2.EngineInfo
    registered_at: float
    last_heartbeat: float
    jobs: dict[str, PlacedJob] = field(default_factory=dict)
    last_used: dict[str, float] = field(default_factory=dict)  # expert_key -> when a job last took it

    @property
    def engine_id(self) -> str:
        return self.info.engine_id

    @property
    def holdings(self) -> common_pb2.ExpertHoldings:
        return self.info.experts

    def held(self) -> dict[str, common_pb2.HeldExpert]:
        return {expert_key(e.name, e.version): e for e in self.info.experts.experts}

    def holds(self, expert: common_pb2.PlannedExpert) -> bool:
        """Whether the engine holds this exact version (the same content) of the expert."""
        held = self.held().get(expert_key(expert.name, expert.version))
        return held is not None and held.content_hash == expert.content_hash

    def references(self) -> dict[str, int]:
        """expert_key -> jobs placed here that use it."""
        counts: dict[str, int] = {}
        for job in self.jobs.values():
            for key in job.experts:
                counts[key] = counts.get(key, 0) + 1
        return counts

    def apply_holdings(self, holdings: common_pb2.ExpertHoldings) -> bool:
        """Take a report of what the engine holds unless one at least as new was applied."""
        if holdings.epoch < self.info.experts.epoch:
            return False
        self.info.experts.CopyFrom(holdings)
        return True

    @property
    def free_slots(self) -> int:
        return max(0, self.info.load.max_num_seqs - len(self.jobs))

    def available_blocks(self) -> int:
        """KV blocks the engine reported it can give without preempting (free, and cached KV it gives
        up on demand), less what jobs placed since that report will take."""
        pending = sum(j.kv_blocks for j in self.jobs.values() if j.placed_at >= self.last_heartbeat)
        return self.info.load.kv_blocks_free + self.info.load.kv_blocks_cached - pending


def kv_blocks_needed(plan: common_pb2.ExpertPlan, model: common_pb2.ModelSpec) -> int:
    """Blocks for the prompt (its byte count bounds its tokens) plus max_tokens of output, for each
    of the n choices (or best_of's samples, or beams). The engine forks them after the prompt, and
    the forks share the prompt's full blocks (its last, partly filled block is copied on a fork's
    first write), so the full prompt blocks count once and everything after them once per sequence."""
    block_size = max(model.block_size, 1)
    tokens = plan.prompt_bytes + plan.generation_params.max_tokens
    if model.max_model_len:
        tokens = min(tokens, model.max_model_len)
    one = math.ceil(tokens / block_size)
    shared = min(plan.prompt_bytes // block_size, one)
    params = plan.generation_params
    sequences = max(1, params.n, params.best_of)  # choices, best_of's samples or beams
    return shared + sequences * (one - shared)


def kv_bytes(blocks: int, model: common_pb2.ModelSpec) -> int:
    """Bytes of K and V for `blocks` blocks: the engine's reported bytes per block (an int8 cache's
    codes and scales), else layers x KV heads x head dim x dtype bytes x 2 per token."""
    if model.kv_bytes_per_block > 0:
        return blocks * model.kv_bytes_per_block
    per_token = 2 * model.num_layers * model.num_kv_heads * model.head_dim * model.dtype_bytes
    return blocks * model.block_size * per_token


class Fleet:
    def __init__(
        self,
        heartbeat_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        lost_memory_s: float | None = None,
    ) -> None:
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.clock = clock
        self.engines: dict[str, Engine] = {}
        self.jobs: dict[str, PlacedJob] = {}
        # Engines dropped for a missed heartbeat, with their jobs, in case they were only slow: the
        # same instance registering again within `lost_memory_s` gets its placements back.
        self.lost: dict[str, Engine] = {}
        self.lost_memory_s = 10 * heartbeat_timeout_s if lost_memory_s is None else lost_memory_s

    def register(self, info: common_pb2.EngineInfo) -> Engine:
        """Add (or replace) an engine, with the placements it keeps in `jobs`. The same
        instance registering again (after a restart of preparation's view, or a heartbeat it
        missed while a long step held it) keeps the jobs placed on it; a new instance under the
        same id (the engine restarted) does not, since those jobs died with the old process."""
        now = self.clock()
        previous = self.engines.get(info.engine_id) or self.lost.pop(info.engine_id, None)
        if previous is not None and previous.info.instance_id != info.instance_id:
            for job_id in previous.jobs:
                self.jobs.pop(job_id, None)
            previous = None
        if previous is not None:
            for job_id, job in previous.jobs.items():
                self.jobs[job_id] = job
        engine = Engine(
            common_pb2.EngineInfo(),
            now,
            now,
            previous.jobs if previous else {},
            previous.last_used if previous else {},
        )
        engine.info.CopyFrom(info)
        self.engines[info.engine_id] = engine
        return engine

    def heartbeat(
        self, engine_id: str, load: common_pb2.EngineLoad, experts: common_pb2.ExpertHoldings | None = None
    ) -> bool:
        engine = self.engines.get(engine_id)
        if engine is None:
            return False
        engine.info.load.CopyFrom(load)
        if experts is not None:
            engine.apply_holdings(experts)
        engine.last_heartbeat = self.clock()
        return True

    def expire(self) -> list[Engine]:
        """Drop engines whose heartbeat is overdue; returns them (with the jobs they had). Their
        jobs are remembered for `lost_memory_s` (see `register`), then forgotten."""
        now = self.clock()
        dead = [e for e in self.engines.values() if now - e.last_heartbeat > self.heartbeat_timeout_s]
        for engine in dead:
            self._drop(engine)
        self._forget_lost(now)
        return dead

    def drop(self, engine_id: str, instance_id: str) -> Engine | None:
        """Drop the engine now if it is listed under that process (`instance_id`; "" matches any),
        as a missed heartbeat would: a call found it unreachable. A new process of the engine
        that registered meanwhile is kept. Returns the engine dropped, if any."""
        engine = self.engines.get(engine_id)
        if engine is None or (instance_id and engine.info.instance_id != instance_id):
            return None
        self._drop(engine)
        return engine

    def _drop(self, engine: Engine) -> None:
        del self.engines[engine.engine_id]
        self.lost[engine.engine_id] = engine
        for job_id in engine.jobs:
            self.jobs.pop(job_id, None)

    def _forget_lost(self, now: float) -> None:
        for engine_id, engine in list(self.lost.items()):
            if now - engine.last_heartbeat > self.lost_memory_s:
                del self.lost[engine_id]

    @contextmanager
    def reservation(
        self, job_id: str, engine: Engine, kv_blocks: int, experts: tuple[str, ...] = ()
    ) -> Iterator[PlacedJob]:
        """Hold one of the engine's slots and `kv_blocks` of its KV for the job while preparation
        works on it. The scope is preparation's only rollback: when the block raises, whatever it
        raised, the reservation is given back; when it ends, the reservation is the job's until
        `release` (the dispatcher's Release). A job holds at most one: reserving again moves it."""
        self.release(job_id)
        now = self.clock()
        job = PlacedJob(job_id, engine.engine_id, kv_blocks, now, experts)
        engine.jobs[job_id] = job
        self.jobs[job_id] = job
        engine.last_used.update(dict.fromkeys(experts, now))
        try:
            yield job
        except BaseException:
            self.release(job_id)
            raise
        # Counted against the engine's reported free KV from the hand-over until a heartbeat
        # taken after it (the engine sees the job's KV only once the dispatcher calls Generate).
        job.placed_at = self.clock()

    def release(self, job_id: str) -> bool:
        """Give the job's reservation back; False when it holds none. A job on an engine dropped
        and remembered (`lost`) is released there too: else that engine's registering again would
        bring back a reservation its dispatcher already gave back, held for ever."""
        job = self.jobs.pop(job_id, None)
        if job is None:
            return self._release_lost(job_id)
        engine = self.engines.get(job.engine_id)
        if engine is not None:
            engine.jobs.pop(job_id, None)
            engine.last_used.update(dict.fromkeys(job.experts, self.clock()))
        return True

    def _release_lost(self, job_id: str) -> bool:
        return any(engine.jobs.pop(job_id, None) is not None for engine in self.lost.values())

    def capacity(self) -> FleetCapacity:
        """The fleet's free sequence slots and free KV blocks, summed over its engines."""
        return FleetCapacity(
            free_slots=sum(e.free_slots for e in self.engines.values()),
            kv_blocks_free=sum(max(0, e.available_blocks()) for e in self.engines.values()),
        )

    def models(self) -> list[common_pb2.ServedModel]:
        """The models the engines serve, in the order they first registered (the first is the
        default model): per model, the smallest context window, the sampling its earliest engine
        reports, how many engines serve it and their free slots."""
        models: dict[str, common_pb2.ServedModel] = {}
        for engine in sorted(self.engines.values(), key=lambda e: e.registered_at):
            spec = engine.info.model
            model = models.get(spec.name)
            if model is None:
                model = models[spec.name] = common_pb2.ServedModel(
                    name=spec.name,
                    base_model_hash=spec.base_model_hash,
                    max_model_len=spec.max_model_len,
                    sampling_defaults=spec.sampling_defaults,
                )
            elif spec.max_model_len and (not model.max_model_len or spec.max_model_len < model.max_model_len):
                model.max_model_len = spec.max_model_len
            model.engines += 1
            model.free_slots += engine.free_slots
        return list(models.values())
