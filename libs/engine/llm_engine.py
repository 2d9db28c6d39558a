"""LLMEngine: the synchronous engine loop, schedule -> run -> postprocess, and its request API."""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import time
from collections import Counter
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from typing import Any

import torch

from libs.engine import host_memory, kv_cache
from libs.engine.adapters.manager import ExpertHoldings, ExpertInfo, ExpertManager, ExpertSpec
from libs.engine.beam_search import BeamDriver
from libs.engine.block_manager import KVCacheManager
from libs.engine.config import ConfigError, EngineConfig
from libs.engine.drafters.loading import drafter_config, is_model_drafter, load_drafter
from libs.engine.drafters.verification import PendingDrafts
from libs.engine.errors import InvalidRequestError
from libs.engine.grammar import GrammarCompiler
from libs.engine.info import ModelInfo
from libs.engine.kernels import TorchOps, select_ops
from libs.engine.models.config import ModelConfig
from libs.engine.models.decoder import DecoderModel
from libs.engine.models.generation_config import sampling_defaults
from libs.engine.models.loader import load_weights
from libs.engine.outputs import EngineStats, RequestOutput
from libs.engine.request import Request
from libs.engine.request_builder import Prompt, RequestBuilder
from libs.engine.runner import Launched, ModelRunner
from libs.engine.sampler import SampledToken
from libs.engine.sampling_params import OutputKind, SamplingParams
from libs.engine.scheduler import Scheduler, SchedulerOutput
from libs.engine.sequence import Sequence, SequenceStatus
from libs.engine.sessions import SessionRef, SessionTable, turn_max_tokens
from libs.engine.speculative import Speculator
from libs.engine.tokenizer import Tokenizer
from libs.experts.manifest import BaseModelIdentity

log = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidRequestError("device", "CUDA was requested but no GPU is available")
    return device


def graph_mode(setting: str, device: torch.device, ops: TorchOps) -> str | None:
    """How the runner uses decode graphs (runner.GRAPH_MODES) for the `cuda_graphs` setting."""
    if setting == "off":
        return None
    if device.type == "cuda":
        if ops.graph_safe:
            return "capture"
        if setting == "on":
            raise ConfigError(
                f"cuda_graphs: on needs graph-safe kernels (EXPERT_KERNELS=triton), not {ops.name}"
            )
        return None
    return "eager" if setting == "on" else None


def async_scheduling(setting: str, device: torch.device) -> bool:
    """Whether steps run ahead of their read-back for the `async_scheduling` setting: "auto" on
    CUDA only (on the CPU the device is the host, so there is nothing to overlap)."""
    return setting == "on" or (setting == "auto" and device.type == "cuda")


def kv_storage_dtype(setting: str, device: torch.device, dtype: torch.dtype, ops: TorchOps) -> torch.dtype:
    """The KV cache's element type for the `kv_cache_dtype` setting. int8 is read by the CPU kernels
    (native and torch); the Triton kernels and CUDA keep the model's dtype (float8 is a later step)."""
    if setting == "int8" and (device.type != "cpu" or ops.name == "triton"):
        raise ConfigError(
            f"kv_cache_dtype: int8 is CPU-only (EXPERT_KV_CACHE_DTYPE; the native or torch kernels), not "
            f"{ops.name} on {device.type}; leave it unset to keep K and V in the model's dtype"
        )
    return kv_cache.storage_dtype(setting, dtype)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        # fp32 is the fast dtype on CPUs without bf16 units; bf16 is the GPU serving default.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    # EngineConfig has already turned any accepted spelling or torch.dtype into one of these names.
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


class LLMEngine:
    """Continuous-batching engine over one model: add requests, call `step()`, read outputs.

    `generate()` and `chat()` wrap the loop for offline use; `AsyncLLMEngine` runs it in a thread
    for servers. Not thread-safe: one thread drives an LLMEngine.
    """

    def __init__(self, config: EngineConfig) -> None:
        started = time.monotonic()
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.model_config = ModelConfig.from_dir(config.model)
        self.tokenizer = Tokenizer.from_dir(config.model)
        # The checkpoint's recommended sampling (generation_config.json), read once with the rest of
        # the checkpoint: the engine service reports it, and a broken file fails the load.
        self.sampling_defaults = sampling_defaults(config.model)
        self.max_model_len = min(
            config.max_model_len or self.model_config.max_position_embeddings,
            self.model_config.max_position_embeddings,
        )
        ops, reason = select_ops(config.kernels, self.model_config.head_dim, self.device, self.dtype)
        self.kernels = ops.name
        self.kv_dtype = kv_storage_dtype(config.cache.kv_cache_dtype, self.device, self.dtype, ops)
        self.model = self._load_model(ops)

        cache = config.cache
        # A model drafter's KV cache comes out of the same budget: its config is read (and checked)
        # before the blocks are counted, its weights loaded after.
        self.draft_config = (
            drafter_config(config, self.model_config, self.tokenizer)
            if is_model_drafter(config.scheduler.speculative)
            else None
        )
        num_blocks = kv_cache.plan_num_blocks(
            cache,
            self.model_config,
            self.kv_dtype,
            self.device,
            config.scheduler.max_num_seqs * self.max_model_len,
            self._drafter_bytes_per_block(),
        )
        self.kv = KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching)
        tensor = kv_cache.allocate(
            num_blocks, self.model_config, cache.block_size, self.kv_dtype, self.device
        )
        self.experts = ExpertManager(self.model_config, config.adapters, self.device, self.dtype)
        self.runner = ModelRunner(
            self.model,
            tensor,
            cache.block_size,
            self.max_model_len,
            config.scheduler.max_num_seqs,
            graph_mode(config.cuda_graphs, self.device, ops),
            self.experts.device_tier,
        )
        self.sessions = SessionTable(self.kv, config.scheduler.max_sessions)
        sched = config.scheduler
        self.speculator = self._speculator(num_blocks)
        self.scheduler = Scheduler(
            sched,
            self.kv,
            adapters=self.experts.device_tier,
            sessions=self.sessions,
            speculator=self.speculator,
            max_model_len=self.max_model_len,
        )
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size)
        self._builder = self._request_builder()
        self._requests: dict[str, Request] = {}
        self._seqs: dict[int, Sequence] = {}
        self._beams = BeamDriver(self.scheduler.add_fork, self.scheduler.finish, self._seqs)
        self._aborted: list[Request] = []
        self.async_scheduling = async_scheduling(config.async_scheduling, self.device)
        self._in_flight: Launched | None = None  # a step run ahead whose tokens are still on the device
        self._counters: Counter[str] = Counter()
        self._finished_by_reason: Counter[str] = Counter()
        self.model_info = self._model_info()
        self._log_ready(ops.name, reason, num_blocks, started)

    def _speculator(self, num_blocks: int) -> Speculator | None:
        """The engine's drafter (EXPERT_SPECULATIVE); a model drafter brings its own KV cache of
        `num_blocks` blocks and hands its drafts' q to the runner's sampler."""
        sched = self.config.scheduler
        if sched.speculative == "off":
            return None
        if not is_model_drafter(sched.speculative):
            return Speculator(sched.speculative, sched.speculative_k, max_rows=sched.speculative_max_rows)
        model = load_drafter(self.config, self.model, self.draft_config, num_blocks, self.max_model_len)
        pending = PendingDrafts()
        self.runner.rejection_rows = pending.rejection_rows
        return Speculator(sched.speculative, sched.speculative_k, model, pending, sched.speculative_max_rows)

    def _drafter_bytes_per_block(self) -> int:
        """Bytes of one block of the model drafter's KV cache (in the model's dtype), 0 without one."""
        if self.draft_config is None:
            return 0
        return kv_cache.bytes_per_block(self.draft_config, self.config.cache.block_size, self.dtype)

    def _load_model(self, ops: TorchOps) -> DecoderModel:
        """The checkpoint's weights, laid out for `ops` on the engine's device."""
        config = self.config
        weights = load_weights(config.model, self.model_config, self.dtype, config.quantization)
        model = DecoderModel(self.model_config, weights, ops, self.device, self.dtype, self.max_model_len)
        del weights
        host_memory.trim()
        return model

    def _request_builder(self) -> RequestBuilder:
        return RequestBuilder(
            self.tokenizer,
            self.model_config,
            self.max_model_len,
            self.kv.pool.num_usable_blocks * self.kv.block_size,
            self.config.scheduler.max_num_seqs,
            self.experts,
            random.Random(self.config.seed),
            self.grammars,
        )

    def _model_info(self) -> ModelInfo:
        config = self.config
        return ModelInfo(
            name=config.model_name,
            base_model=BaseModelIdentity.from_hf_config(self.model_config.raw),
            num_layers=self.model_config.num_layers,
            num_kv_heads=self.model_config.num_kv_heads,
            head_dim=self.model_config.head_dim,
            dtype=str(self.dtype).removeprefix("torch."),
            dtype_bytes=self.dtype_bytes,
            kv_cache_dtype=str(self.kv_dtype).removeprefix("torch."),
            kv_bytes_per_block=kv_cache.bytes_per_block(
                self.model_config, config.cache.block_size, self.kv_dtype
            )
            + self._drafter_bytes_per_block(),
            max_model_len=self.max_model_len,
            block_size=config.cache.block_size,
            max_num_seqs=config.scheduler.max_num_seqs,
            max_sessions=config.scheduler.max_sessions,
            kernels=self.kernels,
            weight_formats=self.model.weight_formats,
            sampling_defaults=self.sampling_defaults,
        )

    def _log_ready(self, kernels: str, reason: str, num_blocks: int, started: float) -> None:
        log.info(
            "engine ready: %s on %s/%s, linear weights %s, with %s (%s); %d %s KV blocks of %d tokens; "
            "max_model_len %d; %.1f s",
            self.model_config.architecture,
            self.device,
            self.dtype,
            ", ".join(f"{count} {kind}" for kind, count in self.model.weight_formats.items()),
            kernels,
            reason,
            num_blocks - 1,
            str(self.kv_dtype).removeprefix("torch."),
            self.config.cache.block_size,
            self.max_model_len,
            time.monotonic() - started,
        )

    @property
    def dtype_bytes(self) -> int:
        """Bytes per element of the weights (and of the KV cache unless it is int8)."""
        return torch.empty((), dtype=self.dtype).element_size()

    @classmethod
    def from_pretrained(
        cls,
        model: str,
        device: str | None = None,
        dtype: str | torch.dtype | None = None,
        **overrides: Any,
    ) -> LLMEngine:
        """An engine for the checkpoint directory `model`; other EngineConfig, CacheConfig or
        SchedulerConfig fields can be given by name (e.g. num_blocks=64, max_num_seqs=8,
        quantization="int4"). `dtype` is a torch.dtype or its name ("float32", "bfloat16", "float16",
        vLLM's "float" and "half"), or None / "auto" for the device's default."""
        return cls(cls.pretrained_config(model, device, dtype, **overrides))

    @staticmethod
    def pretrained_config(
        model: str, device: str | None = None, dtype: str | torch.dtype | None = None, **overrides: Any
    ) -> EngineConfig:
        """The EngineConfig `from_pretrained` builds (ConfigError naming the field for a bad value)."""
        overrides |= {"model": str(model), "device": device or "auto", "dtype": dtype or "auto"}
        return EngineConfig().with_overrides(**overrides)

    # -- requests ------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        experts: ExpertSpec | None = None,
        session: SessionRef | None = None,
        resume: Seq[int] = (),
    ) -> None:
        """Queue a request, optionally with experts: up to 10 ("name", weight) pairs (a bare name
        means weight 1; "name@version" pins a version). Raises InvalidRequestError naming the field
        (ExpertNotFoundError for an expert that is not loaded) for anything unservable.

        With `session`, the request is a turn of that session: its prompt is the session's token
        history and the turn's new tokens (`Tokenizer.encode_turn`); what the engine kept of the
        history is not computed again, and the turn's KV is kept for the next one (`sessions.py`).
        SessionError when the engine cannot take the turn. `resume`: the output tokens an earlier
        run of the request gave its caller; the outputs carry only what follows them
        (RequestBuilder.build)."""
        self.enqueue(
            self.prepare_request(
                request_id,
                prompt,
                params,
                priority=priority,
                arrival_time=arrival_time,
                experts=experts,
                session=session,
                resume=resume,
            )
        )

    def prepare_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        experts: ExpertSpec | None = None,
        session: SessionRef | None = None,
        resume: Seq[int] = (),
    ) -> Request:
        """Validate and tokenize a request without touching engine state (safe from any thread).
        A session turn with a token limit (`SessionRef.max_tokens`) takes token ids, and its
        max_tokens is cut to what the limit leaves (SessionFullError when nothing is)."""
        if session is not None and session.max_tokens is not None:
            params = self._fit_turn(prompt, params or SamplingParams(), session.max_tokens)
        return self._builder.build(
            request_id, prompt, params, priority, arrival_time, experts, session, resume=resume
        )

    def _fit_turn(self, prompt: Prompt, params: SamplingParams, session_max_tokens: int) -> SamplingParams:
        if not (isinstance(prompt, list) and all(isinstance(token, int) for token in prompt)):
            raise InvalidRequestError(
                "prompt", "a session turn with a token limit takes token ids: its history and its own"
            )
        room = turn_max_tokens(len(prompt), params.max_tokens, session_max_tokens, self.max_model_len)
        return params if room == params.max_tokens else dataclasses.replace(params, max_tokens=room)

    def enqueue(self, request: Request) -> None:
        """Hand a prepared request to the scheduler."""
        if request.request_id in self._requests:
            raise InvalidRequestError("request_id", f"{request.request_id!r} is already in use")
        if request.session is not None:
            self.sessions.begin_turn(request.seqs[0], request.session)
        self.experts.pin(request.experts)
        self._requests[request.request_id] = request
        request.runs_ahead = self._can_run_ahead(request)
        seq = request.seqs[0]
        self._seqs[seq.seq_id] = seq
        self.scheduler.add(seq)

    def _can_run_ahead(self, request: Request) -> bool:
        """Whether the request's next step can be built before its last token is on the host: not
        when that token picks what the next step computes or how it samples (drafts, beams, forks
        into n outputs, a format's mask, penalties over the output so far)."""
        params = request.params
        return (
            self.speculator is None
            and request.beam is None
            and params.num_seqs == 1
            and params.structured is None
            and not params.uses_penalties
        )

    def abort_request(self, request_ids: str | Seq[str]) -> None:
        """Stop requests now and free their blocks; their final output (finish_reason "abort") is
        returned by the next `step()`. Unknown or finished ids are ignored."""
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            request = self._requests.pop(request_id, None)
            if request is None:
                continue
            now = time.monotonic()
            if request.beam is not None:
                self._abort_beams(request, now)
                continue
            for seq in request.seqs:
                if not seq.is_finished:
                    self._drop_in_flight(seq)
                    self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
                    request.mark_finished(seq, SequenceStatus.FINISHED_ABORTED, now)
                self._seqs.pop(seq.seq_id, None)
            # Outputs not yet forked (n > 1) are aborted too.
            for index in range(len(request.seqs), request.params.num_seqs):
                seq = request.seqs[0].fork(index)
                seq.status = SequenceStatus.FINISHED_ABORTED
                request.add_sequence(seq)
                request.mark_finished(seq, SequenceStatus.FINISHED_ABORTED, now)
            self.experts.unpin(request.experts)
            self._finished_by_reason["abort"] += 1
            self._aborted.append(request)

    def _abort_beams(self, request: Request, now: float) -> None:
        """Abort a beam search: its beams are freed and its output is the best it has."""
        self._beams.abort(request.beam)
        self._beams.forget(request.request_id)
        request.record_finish(now)
        self.experts.unpin(request.experts)
        self._finished_by_reason["abort"] += 1
        self._aborted.append(request)

    # -- sessions ------------------------------------------------------------------------------

    def end_session(self, session_id: str) -> bool:
        """End a session: its running turn is aborted and every block it keeps freed. False for a
        session this engine does not hold."""
        active = self.sessions.active_request(session_id)
        if not self.sessions.end(session_id):
            return False
        if active is not None:
            self.abort_request(active)  # its session is gone, so its blocks are freed, not kept
        return True

    def expire_sessions(self) -> list[str]:
        """End the sessions idle past their idle timeout; returns their ids."""
        expired = self.sessions.expired()
        for session_id in expired:
            self.end_session(session_id)
        return expired

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or bool(self._aborted) or self._in_flight is not None

    def unfinished_request_ids(self) -> list[str]:
        return list(self._requests)

    # -- experts -------------------------------------------------------------------------------

    def load_expert(
        self, source: bytes | str | os.PathLike[str], trusted_keys_dir: str | os.PathLike[str] | None = None
    ) -> tuple[str, str]:
        """Verify a `.expert` package (a path or its bytes) against the trusted keys and hold its
        weights; returns (name, version). Refusals raise ExpertRefusedError naming the problem and
        change nothing. The package must be for this engine's base model."""
        expert = self.experts.load(source, trusted_keys_dir)
        return expert.name, expert.version

    def unload_expert(self, name: str) -> None:
        """Forget the current version of an expert (refused with ExpertInUseError while requests use it)."""
        self.experts.unload(name)

    def list_experts(self) -> list[ExpertInfo]:
        return self.experts.experts()

    def expert_holdings(self) -> ExpertHoldings:
        """The experts held, the tiers' budgets and the change counter, taken together."""
        return self.experts.holdings()

    # -- the loop ------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, and return the outputs of requests that progressed.

        Run ahead (asynchronous scheduling, `async_scheduling`): the step is queued on the device
        with its sampled tokens left there as the next step's inputs, and the outputs returned are
        the previous step's, read back while this one runs. A step runs ahead only when no
        unfinished request needs its tokens on the host before the next step can be built
        (`_runs_ahead`); otherwise the step in flight is read back first and the step runs in
        series, as without the setting."""
        outputs = [out for r in self._aborted if (out := r.output()) is not None]
        self._aborted.clear()
        ahead = self._runs_ahead()
        if self._in_flight is not None and not ahead:
            outputs += self._read_back()
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return outputs + (self._read_back() if self._in_flight is not None else [])
        self._on_scheduled(plan)
        self._counters["steps"] += 1
        if ahead:
            launched = self.runner.launch(plan, self._in_flight)
            self.scheduler.on_step_done(plan)
            for seq in [] if launched is None else launched.seqs:
                seq.append_placeholder()
            if self._in_flight is not None:
                outputs += self._read_back()
            self._in_flight = launched
            return outputs
        samples = self.runner.execute(plan)
        kept = self.scheduler.on_step_done(plan, {i: [t.token_id for t in ts] for i, ts in samples.items()})
        touched = self._append_samples(samples, kept)
        return outputs + self._collect_outputs(touched)

    def _runs_ahead(self) -> bool:
        return self.async_scheduling and all(r.runs_ahead for r in self._requests.values())

    def _read_back(self) -> list[RequestOutput]:
        """The step in flight's tokens, read back in place of their placeholders; a sequence that
        ended on one (a stop, `max_tokens`) drops the token the next step sampled after it and is
        left as if it had stopped in series. Returns the progressed requests' outputs."""
        launched, self._in_flight = self._in_flight, None
        if launched is None:
            return []
        now = time.monotonic()
        touched: dict[str, Request] = {}
        for seq_id, (sample,) in self.runner.collect(launched).items():
            seq = self._seqs.get(seq_id)
            if seq is None or seq.is_finished:  # aborted meanwhile, or ended on the step before
                continue
            request = self._requests[seq.request_id]
            touched[request.request_id] = request
            seq.resolve_placeholder(sample.token_id)
            if not self._record_token(seq, request, sample, now):
                self.kv.register_computed_blocks(seq)
        return self._collect_outputs(touched)

    def _on_scheduled(self, plan: SchedulerOutput) -> None:
        """Counts the prompt tokens the step computes and when each request was first scheduled."""
        now = time.monotonic()
        for seq, num_new in plan.scheduled:
            request = self._requests[seq.request_id]
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = now
            request.metrics.num_draft_tokens += seq.num_draft_tokens
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                self._counters["prompt_tokens"] += min(
                    num_new, seq.num_prompt_tokens - seq.num_computed_tokens
                )

    def _append_samples(
        self, samples: dict[int, list[SampledToken]], kept: dict[int, int]
    ) -> dict[str, Request]:
        """Appends each sequence's sampled tokens, finishing those that stop; returns the requests
        that progressed. `kept`: for a sequence that verified drafts, how many it keeps (its
        samples are then one per position: the kept drafts, then the token after them)."""
        now = time.monotonic()
        touched: dict[str, Request] = {}
        for seq_id, sampled in samples.items():
            seq = self._seqs[seq_id]
            request = self._requests[seq.request_id]
            touched[request.request_id] = request
            if request.beam is not None:
                self._on_beam_sample(request, seq, sampled[0], now)
                continue
            if seq_id in kept:
                self._append_verified(seq, request, sampled[: kept[seq_id] + 1], now)
                continue
            targets = [seq]
            if len(sampled) > 1:  # the first sample of an n > 1 request: fork the other outputs
                targets += self._fork(seq, request, len(sampled))
            for target, sample in zip(targets, sampled, strict=True):
                self._append_one(target, request, sample, now)
        return touched

    def _on_beam_sample(self, request: Request, seq: Sequence, sample: SampledToken, now: float) -> None:
        """A beam's candidates; the beam search steps once every beam has given its own."""
        self._counters["generation_tokens"] += 1
        request.metrics.num_generation_tokens += 1
        if request.metrics.first_token_time is None:
            request.metrics.first_token_time = now
        self._beams.on_sample(request.beam, seq, list(sample.top_logprobs))
        if request.beam.done:
            self._beams.forget(request.request_id)
            request.record_finish(now)

    def _append_one(self, seq: Sequence, request: Request, sample: SampledToken, now: float) -> bool:
        """Append one token; True if it ended the sequence."""
        seq.append_token(sample.token_id)
        return self._record_token(seq, request, sample, now)

    def _record_token(self, seq: Sequence, request: Request, sample: SampledToken, now: float) -> bool:
        """Count and check a token now in `seq`; True if it ended the sequence (which is retired)."""
        self._counters["generation_tokens"] += 1
        status = request.on_token(seq, sample, now)
        if status is None:
            return False
        self._drop_in_flight(seq)
        self.scheduler.finish(seq, status)
        request.mark_finished(seq, status, now)
        self._seqs.pop(seq.seq_id, None)
        return True

    def _drop_in_flight(self, seq: Sequence) -> None:
        """A sequence ending now forgets the tokens sampled after its end by a step still in
        flight: as in series, its last token is not computed and holds no block of its own."""
        if seq.drop_placeholders():
            seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens - 1)
            self.kv.trim(seq, seq.num_computed_tokens)

    def _append_verified(
        self, seq: Sequence, request: Request, sampled: list[SampledToken], now: float
    ) -> None:
        """The kept drafts and the token after them, one by one, as ordinary decoding would have
        produced them: a stop (token, string, format, max_tokens) drops whatever follows it."""
        request.metrics.num_draft_tokens_accepted += len(sampled) - 1
        for i, sample in enumerate(sampled):
            if self._append_one(seq, request, sample, now):
                return
            if i < len(sampled) - 1:
                self.scheduler.draft_kept(seq)

    def _fork(self, seq: Sequence, request: Request, n: int) -> list[Sequence]:
        """The other n - 1 outputs of an n > 1 request, forked from its prompt's sequence."""
        seq.num_pending_forks = 1
        children = []
        for index in range(1, n):
            child = seq.fork(index)
            self.scheduler.add_fork(seq, child)
            self._seqs[child.seq_id] = child
            request.add_sequence(child)
            children.append(child)
        return children

    def _collect_outputs(self, touched: dict[str, Request]) -> list[RequestOutput]:
        """The touched requests' outputs; a finished request is forgotten and its experts unpinned."""
        outputs = []
        for request in touched.values():
            out = request.output()
            if out is not None:
                outputs.append(out)
            if request.finished:
                del self._requests[request.request_id]
                self.experts.unpin(request.experts)
                self._finished_by_reason[out.finish_reason if out else "stop"] += 1
        return outputs

    # -- offline helpers -----------------------------------------------------------------------

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        priority: int = 0,
        experts: ExpertSpec | Seq[ExpertSpec | None] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion (batched together) and return their final outputs in order.

        `experts` is one expert list for every prompt, or a list of them (or None) per prompt.
        """
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and all(isinstance(p, int | Mapping) for p in prompts)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise InvalidRequestError("params", f"{len(params)} parameter sets for {len(prompts)} prompts")
        per_prompt = _per_prompt_experts(experts, len(prompts))
        base = f"generate-{self._counters['generate_calls']}"
        self._counters["generate_calls"] += 1
        ids = [f"{base}-{i}" for i in range(len(prompts))]
        try:
            for request_id, prompt, p, spec in zip(ids, prompts, params, per_prompt, strict=True):
                final = dataclasses.replace(p, output_kind=OutputKind.FINAL_ONLY)
                self.add_request(request_id, prompt, final, priority=priority, experts=spec)
            results: dict[str, RequestOutput] = {}
            while len(results) < len(ids):
                for out in self.step():
                    if out.finished:
                        results[out.request_id] = out
        except BaseException:
            self.abort_request(ids)
            self.step()
            raise
        return [results[i] for i in ids]

    def chat(
        self,
        conversations: Seq[Mapping[str, Any]] | Seq[Seq[Mapping[str, Any]]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Like `generate` for one conversation (a list of messages) or a list of them."""
        if conversations and isinstance(conversations[0], Mapping):
            conversations = [conversations]
        return self.generate([list(c) for c in conversations], params)

    # -- metrics -------------------------------------------------------------------------------

    def get_stats(self) -> EngineStats:
        """Engine, KV-cache and expert figures for metrics."""
        usage = self.kv.usage()
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_num_blocks=usage.num_blocks,
            kv_used_blocks=usage.num_used_blocks,
            kv_free_blocks=usage.num_free_blocks,
            kv_usage=usage.usage,
            kv_cached_blocks=usage.num_cached_blocks,
            kv_session_blocks=usage.num_session_blocks,
            prefix_cache_queries=usage.prefix_queries,
            prefix_cache_hits=usage.prefix_hits,
            prefix_cache_hit_rate=usage.prefix_hit_rate,
            num_preemptions_total=self.scheduler.num_preemptions_total,
            prompt_tokens_total=self._counters["prompt_tokens"],
            generation_tokens_total=self._counters["generation_tokens"],
            requests_finished_total=dict(self._finished_by_reason),
            num_steps_total=self._counters["steps"],
            experts=self.experts.stats(),
            sessions=self.sessions.stats(),
            speculative=None if self.speculator is None else self.speculator.snapshot(),
            speculative_fallback=None if self.speculator is None else self.speculator.fallback_snapshot(),
        )


def _per_prompt_experts(experts: object, count: int) -> list:
    """One expert list per prompt from either a shared list or a list of per-prompt lists."""
    if experts is None:
        return [None] * count
    if (
        isinstance(experts, list | tuple)
        and experts
        and all(e is None or isinstance(e, list) for e in experts)
    ):
        if len(experts) != count:
            raise InvalidRequestError("experts", f"{len(experts)} expert lists for {count} prompts")
        return list(experts)
    return [experts] * count
