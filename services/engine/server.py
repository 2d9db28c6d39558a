"""EngineService: the gRPC front of the engine. Translates protos to engine calls and back."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from libs.engine.adapters.manager import ExpertHoldings
from libs.engine.adapters.registry import ExpertNotFoundError
from libs.engine.async_engine import AsyncLLMEngine
from libs.engine.outputs import Logprob, RequestOutput
from libs.engine.sampling_params import OutputKind, SamplingParams
from libs.engine.sessions import SessionRef
from libs.engine.tokenizer import ChatTemplateError, Tokenizer, UnencodableTextError
from libs.engine.tokenizer.turns import encode_turn
from libs.errors import invalid_argument, not_found, unavailable
from libs.gen.expert.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from libs.response_format import to_structured
from services.engine.metrics import EngineMetrics
from services.engine.tool_calls import RequestTools, session_messages

FINISH_REASONS = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
}


# GenerationParams.early_stopping's words for SamplingParams' values ("never" is both).
_EARLY_STOPPING = {"": False, "false": False, "true": True}


def sampling_params(params: common_pb2.GenerationParams) -> SamplingParams:
    """The engine's SamplingParams; zero top_p / repetition_penalty / max_tokens mean "not set", and
    `response_format` becomes the format the engine enforces (`structured`)."""
    return SamplingParams(
        temperature=params.temperature,
        max_tokens=params.max_tokens or None,
        top_p=params.top_p or 1.0,
        top_k=params.top_k,
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty or 1.0,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        stop=list(params.stop),
        seed=params.seed if params.HasField("seed") else None,
        n=params.n or 1,
        logprobs=params.logprobs if params.HasField("logprobs") else None,
        output_kind=OutputKind.DELTA,
        structured=to_structured(params.response_format),
        ignore_eos=params.ignore_eos,
        skip_special_tokens=params.skip_special_tokens if params.HasField("skip_special_tokens") else True,
        speculative=params.speculative if params.HasField("speculative") else None,
        best_of=params.best_of or None,
        use_beam_search=params.use_beam_search,
        length_penalty=params.length_penalty if params.HasField("length_penalty") else 1.0,
        early_stopping=_EARLY_STOPPING.get(params.early_stopping, params.early_stopping),
    )


class TokenTexts:
    """Each token decoded on its own (as OpenAI shows tokens) with the bytes it adds to the text,
    remembered per id: a vocabulary is bounded, and logprobs name the same tokens again and again."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._known: dict[int, tuple[str, bytes]] = {}

    def __call__(self, token_id: int) -> tuple[str, bytes]:
        known = self._known.get(token_id)
        if known is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            raw = self.tokenizer.token_bytes(token_id, skip_special_tokens=False)
            known = self._known[token_id] = (text, text.encode() if raw is None else raw)
        return known

    def logprobs(
        self, token_ids: list[int], ranked: list[dict[int, Logprob]], k: int
    ) -> list[common_pb2.TokenLogprob]:
        """The sampled tokens' logprobs, each with its position's `k` most likely tokens, most likely
        first (a position also holds the sampled token under its own rank, which may be lower)."""
        out = []
        for token_id, position in zip(token_ids, ranked, strict=True):
            text, raw = self(token_id)
            top = []
            for alt in sorted((p for p in position.values() if 1 <= p.rank <= k), key=lambda p: p.rank):
                alt_text, alt_raw = self(alt.token_id)
                top.append(
                    common_pb2.TopLogprob(
                        token_id=alt.token_id, token=alt_text, logprob=alt.logprob, token_bytes=alt_raw
                    )
                )
            out.append(
                common_pb2.TokenLogprob(
                    token_id=token_id,
                    token=text,
                    logprob=position[token_id].logprob,
                    top_logprobs=top,
                    token_bytes=raw,
                )
            )
        return out


class EngineServicer(engine_pb2_grpc.EngineServiceServicer):
    """Created before the model is loaded (so health can answer); calls are UNAVAILABLE until
    `engine` is set."""

    def __init__(self, engine: AsyncLLMEngine | None, metrics: EngineMetrics, max_expert_bytes: int) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_expert_bytes = max_expert_bytes
        self._token_texts: TokenTexts | None = None

    @property
    def token_texts(self) -> TokenTexts:
        if self._token_texts is None:  # the engine (and its tokenizer) comes after the servicer
            self._token_texts = TokenTexts(self._ready().tokenizer)
        return self._token_texts

    def _ready(self) -> AsyncLLMEngine:
        if self.engine is None:
            raise unavailable("the engine is still loading its model")
        return self.engine

    def _prompt(
        self, model_input: common_pb2.ModelInput, tools: RequestTools
    ) -> str | list[int] | list[dict[str, Any]]:
        if model_input.HasField("text"):
            return model_input.text
        if model_input.HasField("token_ids"):
            return list(model_input.token_ids.ids)  # the engine checks each against the vocabulary
        if not model_input.conversation.messages:
            raise invalid_argument("input", "neither text nor a conversation was given")
        return tools.prompt(model_input.conversation.messages)

    async def Generate(
        self, request: engine_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.GenerateResponse]:
        self._ready()
        request_id = request.request_id or uuid.uuid4().hex
        experts = [
            (e.name + (f"@{e.version}" if e.version else ""), e.weight or 1.0) for e in request.experts
        ]
        params = sampling_params(request.params)
        # A session lists its tools in the fallback's system message (whatever the template), so
        # its calls take the fallback's format.
        tools = RequestTools(self.engine.tokenizer, request.params, fallback=request.HasField("session"))
        if tools.enabled:  # reception refuses a response_format beside enabled tools
            params.structured = tools.structured()
        # A format is compiled on an executor thread (cached by content) before the request joins
        # the batch: a slow schema holds neither the engine thread nor this event loop.
        await self.engine.compile_structured(params.structured)
        session, turn_input = None, []
        if request.HasField("session"):
            prompt, turn_input = self._session_turn(request.session)
            session = SessionRef(
                request.session.session_id,
                history_tokens=len(request.session.history),
                idle_seconds=request.session.idle_seconds,
                max_tokens=request.session.max_tokens,  # the engine cuts the reply to what it leaves
            )
        else:
            prompt = self._prompt(request.input, tools)
        stream = self.engine.add_request(
            request_id,
            prompt,
            params,
            priority=request.priority,
            experts=experts or None,
            stream_interval=max(1, request.stream_interval),  # held back on the engine thread
            on_finished=self._observe,  # every finished request once, a cancelled call's too
            session=session,
            resume=request.resume_token_ids,  # a job's new run goes on from what its caller has
        )
        expiry = _Expiry(self.engine, request_id, request.deadline if request.HasField("deadline") else None)
        finished: set[int] = set()  # the choices whose finish_reason was sent
        split = tools.split(self._resumed_text(request.resume_token_ids))
        try:
            async for output in stream:
                responses = self._responses(output, finished, expiry.expired, request.params.logprobs)
                for response in responses if split is not None else ():
                    split.apply(response)
                if output.finished and turn_input:
                    responses[-1].session_input_token_ids.extend(turn_input)
                for response in responses:
                    yield response
        finally:
            expiry.cancel()
            if not stream.finished:  # the caller went away or was cancelled: free the KV now
                self.engine.abort(request_id)

    def _resumed_text(self, token_ids: Sequence[int]) -> str:
        return self.engine.tokenizer.decode(list(token_ids)) if token_ids else ""

    def _session_turn(self, turn: engine_pb2.SessionTurn) -> tuple[list[int], list[int]]:
        """A session turn's prompt (its history and the tokens the turn adds) and those added tokens."""
        if not turn.session_id:
            raise invalid_argument("session.session_id", "must not be empty")
        messages = session_messages(turn.messages, turn.tools)
        try:
            added = encode_turn(self.engine.tokenizer, list(turn.history), messages)
        except ChatTemplateError as exc:
            raise invalid_argument(f"session.{exc.field}", exc.description) from None
        except UnencodableTextError as exc:
            raise invalid_argument("session.messages", str(exc)) from None
        return [*turn.history, *added], added

    async def ReleaseSession(
        self, request: engine_pb2.ReleaseSessionRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.ReleaseSessionResponse:
        if not request.session_id:
            raise invalid_argument("session_id", "must not be empty")
        return engine_pb2.ReleaseSessionResponse(found=await self._ready().end_session(request.session_id))

    async def Abort(
        self, request: engine_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.AbortResponse:
        if not request.request_id:
            raise invalid_argument("request_id", "must not be empty")
        return engine_pb2.AbortResponse(found=self._ready().abort(request.request_id))

    def _observe(self, output: RequestOutput) -> None:
        self.metrics.observe_request(output.metrics, output.outputs[0].finish_reason or "stop")

    def _responses(
        self, output: RequestOutput, finished: set[int], timed_out: bool, top_logprobs: int = 0
    ) -> list[engine_pb2.GenerateResponse]:
        """One message per choice with something new (text, tokens, or its end); the usage and the
        experts ride on the very last message, once every choice finished."""
        responses = []
        for completion in output.outputs:
            ends = completion.finish_reason is not None and completion.index not in finished
            if not (completion.text or completion.token_ids or ends):
                continue
            response = engine_pb2.GenerateResponse(
                index=completion.index, text=completion.text, token_ids=completion.token_ids
            )
            if completion.logprobs:
                response.logprobs.extend(
                    self.token_texts.logprobs(completion.token_ids, completion.logprobs, top_logprobs)
                )
            if ends:
                finished.add(completion.index)
                response.finish_reason = (
                    common_pb2.FINISH_REASON_TIMEOUT
                    if timed_out and completion.finish_reason == "abort"
                    else FINISH_REASONS.get(completion.finish_reason, common_pb2.FINISH_REASON_STOP)
                )
            responses.append(response)
        if output.finished:
            m = output.metrics
            last = responses[-1] if responses else engine_pb2.GenerateResponse(index=output.outputs[-1].index)
            last.usage.CopyFrom(
                common_pb2.GenerationUsage(
                    prompt_tokens=m.num_prompt_tokens,
                    completion_tokens=m.num_generation_tokens,  # summed over the choices
                    cached_tokens=m.num_cached_tokens,
                    queue_ms=(m.queue_time or 0.0) * 1000,
                    ttft_ms=(m.ttft or 0.0) * 1000,
                    decode_ms=(m.decode_time or 0.0) * 1000,
                    draft_tokens=m.num_draft_tokens,
                    accepted_draft_tokens=m.num_draft_tokens_accepted,
                )
            )
            last.experts.extend(
                common_pb2.AppliedExpert(
                    name=e.name, version=e.version, adapter_type=e.adapter_type, weight=e.weight
                )
                for e in output.experts
            )
            if not responses:
                responses.append(last)
        return responses

    async def GetStats(
        self, request: engine_pb2.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.GetStatsResponse:
        stats = self._ready().get_stats()
        experts = stats.experts
        return engine_pb2.GetStatsResponse(
            load=engine_load(self.engine),
            model=model_spec(self.engine),
            prefix_cache_queries=stats.prefix_cache_queries,
            prefix_cache_hits=stats.prefix_cache_hits,
            preemptions_total=stats.num_preemptions_total,
            prompt_tokens_total=stats.prompt_tokens_total,
            generation_tokens_total=stats.generation_tokens_total,
            experts_held=experts.experts_held if experts else 0,
            experts_resident=experts.experts_resident if experts else 0,
            expert_host_bytes=experts.host_bytes if experts else 0,
            expert_device_bytes=experts.device_bytes if experts else 0,
            session_evictions_total=stats.sessions.evictions_total,
            session_recomputes_total=sum(stats.sessions.recomputes_total.values()),
        )

    async def LoadExpert(
        self, request_iterator: AsyncIterator[engine_pb2.LoadExpertRequest], context: grpc.aio.ServicerContext
    ) -> engine_pb2.LoadExpertResponse:
        self._ready()
        size, chunks, received = None, [], 0
        async for part in request_iterator:
            if part.HasField("size"):
                if size is not None or received:
                    raise invalid_argument("size", "must come once, in the first message")
                if not 0 < part.size <= self.max_expert_bytes:
                    raise invalid_argument(
                        "size", f"must be in (0, {self.max_expert_bytes}] bytes, got {part.size}"
                    )
                size = part.size
            else:
                if size is None:
                    raise invalid_argument("size", "the first message must carry the package size")
                received += len(part.chunk)
                if received > size:
                    raise invalid_argument("chunk", f"more than the announced {size} bytes")
                chunks.append(part.chunk)
        if size is None or received != size:
            raise invalid_argument("chunk", f"received {received} of {size or 0} announced bytes")
        name, version = await self.engine.load_expert(b"".join(chunks))
        holdings = await self.engine.expert_holdings()
        info = next(e for e in holdings.experts if e.name == name and e.version == version)
        return engine_pb2.LoadExpertResponse(
            name=name, version=version, content_hash=info.content_hash, holdings=expert_holdings(holdings)
        )

    async def UnloadExpert(
        self, request: engine_pb2.UnloadExpertRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.UnloadExpertResponse:
        self._ready()
        try:
            await self.engine.unload_expert(request.name)
        except ExpertNotFoundError as exc:
            raise not_found(str(exc)) from None
        return engine_pb2.UnloadExpertResponse(holdings=expert_holdings(await self.engine.expert_holdings()))

    async def ListExperts(
        self, request: engine_pb2.ListExpertsRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.ListExpertsResponse:
        self._ready()
        return engine_pb2.ListExpertsResponse(
            experts=[
                engine_pb2.EngineExpert(
                    name=e.name,
                    version=e.version,
                    adapter_type=e.adapter_type,
                    content_hash=e.content_hash,
                    current=e.current,
                    host_bytes=e.host_bytes,
                    device_bytes=e.device_bytes,
                    resident=e.resident,
                    active_requests=e.active_requests,
                )
                for e in await self.engine.list_experts()
            ]
        )


class _Expiry:
    """Aborts a request when its deadline comes; the abort ends its stream with the text so far."""

    def __init__(self, engine: AsyncLLMEngine, request_id: str, deadline: Timestamp | None) -> None:
        self.expired = False
        self._handle: asyncio.TimerHandle | None = None
        if deadline is not None:
            delay = max(0.0, deadline.ToNanoseconds() / 1e9 - time.time())
            self._handle = asyncio.get_running_loop().call_later(delay, self._expire, engine, request_id)

    def _expire(self, engine: AsyncLLMEngine, request_id: str) -> None:
        self.expired = True
        engine.abort(request_id)

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()


def expert_holdings(holdings: ExpertHoldings) -> common_pb2.ExpertHoldings:
    return common_pb2.ExpertHoldings(
        epoch=holdings.epoch,
        host_budget_bytes=holdings.host_budget_bytes,
        device_budget_bytes=holdings.device_budget_bytes,
        experts=[
            common_pb2.HeldExpert(
                name=e.name,
                version=e.version,
                content_hash=e.content_hash,
                host_bytes=e.host_bytes,
                device_bytes=e.footprint_bytes,
                active_requests=e.active_requests,
            )
            for e in holdings.experts
        ],
    )


def engine_load(engine: AsyncLLMEngine) -> common_pb2.EngineLoad:
    load = engine.load()
    return common_pb2.EngineLoad(
        kv_blocks_total=load.kv_blocks_total,
        kv_blocks_used=load.kv_blocks_used,
        kv_blocks_cached=load.kv_blocks_cached,
        kv_blocks_free=load.kv_blocks_free,
        running=load.running,
        waiting=load.waiting,
        max_num_seqs=load.max_num_seqs,
        sessions=load.sessions,
        max_sessions=load.max_sessions,
        kv_blocks_sessions=load.kv_blocks_sessions,
    )


def model_spec(engine: AsyncLLMEngine) -> common_pb2.ModelSpec:
    info = engine.model_info
    return common_pb2.ModelSpec(
        name=info.name,
        base_model_hash=info.base_model.config_hash,
        num_layers=info.num_layers,
        num_kv_heads=info.num_kv_heads,
        head_dim=info.head_dim,
        dtype_bytes=info.dtype_bytes,
        kv_bytes_per_block=info.kv_bytes_per_block,
        kv_cache_dtype=info.kv_cache_dtype,
        max_model_len=info.max_model_len,
        block_size=info.block_size,
        sampling_defaults=common_pb2.SamplingDefaults(**info.sampling_defaults),
    )
