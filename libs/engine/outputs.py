"""What the engine hands back: per-request outputs (streamed and final) and their timings."""

from __future__ import annotations

from dataclasses import dataclass, field

from libs.engine.sampling_params import OutputKind
from libs.engine.sessions import SessionStats


@dataclass(frozen=True)
class Logprob:
    token_id: int
    logprob: float
    rank: int  # 1 = most likely


@dataclass
class CompletionOutput:
    """One of a request's n outputs. With the CUMULATIVE output kind `text`, `token_ids` and
    `logprobs` hold everything so far; with DELTA only what this update added."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timestamps (time.monotonic seconds) and derived latencies of one request."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    # Speculative decoding: drafted tokens verified, and of those the ones kept in the output.
    num_draft_tokens: int = 0
    num_draft_tokens_accepted: int = 0
    inter_token_latencies: list[float] = field(default_factory=list)

    @property
    def queue_time(self) -> float | None:
        """Seconds from arrival until first scheduled."""
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        """Time to first token, seconds from arrival."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def decode_time(self) -> float | None:
        """Seconds from the first token to the last."""
        if self.first_token_time is None or self.last_token_time is None:
            return None
        return self.last_token_time - self.first_token_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    @property
    def decode_tokens_per_second(self) -> float | None:
        decode = self.decode_time
        if not decode or self.num_generation_tokens < 2:
            return None
        return (self.num_generation_tokens - 1) / decode


@dataclass(frozen=True)
class AppliedExpert:
    """An expert the engine applied to a request: exactly this version, with this weight."""

    name: str
    version: str
    adapter_type: str
    weight: float


@dataclass
class RequestOutput:
    """The state of a request after an engine step (or at the end, with `finished` set)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    experts: list[AppliedExpert] = field(default_factory=list)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


def merge_outputs(older: RequestOutput, newer: RequestOutput, kind: OutputKind) -> RequestOutput:
    """One output standing for two consecutive ones of a request (for a consumer that fell behind)."""
    if kind != OutputKind.DELTA:
        return newer  # cumulative outputs already hold everything
    by_index = {c.index: c for c in older.outputs}
    merged = []
    for c in newer.outputs:
        before = by_index.get(c.index)
        if before is None:
            merged.append(c)
            continue
        logprobs = None if c.logprobs is None else [*(before.logprobs or []), *c.logprobs]
        merged.append(
            CompletionOutput(
                index=c.index,
                text=before.text + c.text,
                token_ids=[*before.token_ids, *c.token_ids],
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
                logprobs=logprobs,
                cumulative_logprob=c.cumulative_logprob,
            )
        )
    return RequestOutput(
        newer.request_id,
        newer.prompt,
        newer.prompt_token_ids,
        merged,
        newer.finished,
        newer.metrics,
        newer.experts,
    )


@dataclass(frozen=True)
class ExpertStats:
    """The expert tiers' figures, for the engine's metrics."""

    experts_held: int
    host_bytes: int
    device_bytes: int
    experts_resident: int
    experts_pinned_on_device: int
    loads_total: int
    load_hits_total: int
    host_evictions_total: int
    device_loads_total: int
    device_hits_total: int
    device_evictions_total: int


@dataclass(frozen=True)
class SpeculativeStats:
    """Speculative decoding's counters, for the drafter the engine runs."""

    drafter: str
    drafted_tokens_total: int
    accepted_tokens_total: int
    verify_steps_total: int  # sequence-steps that verified drafts
    fallbacks_total: int  # times a sequence paused drafting for low acceptance

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens_total / self.drafted_tokens_total if self.drafted_tokens_total else 0.0


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine for the service layer's metrics (vLLM's gauge/counter set)."""

    num_running: int
    num_waiting: int
    kv_num_blocks: int  # = kv_used_blocks + kv_cached_blocks + kv_free_blocks (KVCacheUsage)
    kv_used_blocks: int  # held by live sequences
    kv_free_blocks: int  # empty
    kv_usage: float  # fraction of blocks in use
    kv_cached_blocks: int  # reusable KV nothing live holds: idle sessions' and unreferenced prefixes
    kv_session_blocks: int  # of the cached, those idle sessions keep
    prefix_cache_queries: int  # tokens looked up
    prefix_cache_hits: int  # tokens found
    prefix_cache_hit_rate: float
    num_preemptions_total: int
    prompt_tokens_total: int
    generation_tokens_total: int
    requests_finished_total: dict[str, int]  # by finish reason
    num_steps_total: int
    experts: ExpertStats | None = None
    sessions: SessionStats | None = None
    speculative: SpeculativeStats | None = None  # None: the engine does not speculate
    # The base drafter's n-gram fallback (requests without experts), counted apart; else None.
    speculative_fallback: SpeculativeStats | None = None
