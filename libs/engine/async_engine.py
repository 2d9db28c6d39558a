"""AsyncLLMEngine: the engine loop in its own thread, requests and outputs on an asyncio loop.

The model steps in a dedicated thread (torch releases the GIL while it computes), so the event
loop stays free for the network. That thread also builds the model, and no other thread runs
torch's parallel ops: every thread that does gets its own OpenMP team, and once a process holds
more OpenMP threads than cores, libgomp stops spin-waiting between parallel regions, which halved
decode speed on a 2-core machine (23 instead of 48 tokens/s on the default model).

Everything the event loop asks of the engine crosses into the engine thread as a typed command
on one queue (`AddRequest`, `AbortRequest`, `CallInEngine`), handled between steps; outputs come
back with `call_soon_threadsafe` into per-request streams (`streams.py`), so the decode loop never
waits for a consumer, however slow.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from libs.engine.adapters.manager import ExpertHoldings, ExpertInfo, ExpertSpec
from libs.engine.adapters.registry import ExpertError
from libs.engine.config import EngineConfig
from libs.engine.errors import InvalidRequestError
from libs.engine.info import EngineLoad, ModelInfo
from libs.engine.llm_engine import LLMEngine, Prompt
from libs.engine.outputs import EngineStats, RequestOutput, merge_outputs
from libs.engine.request import Request
from libs.engine.sampling_params import OutputKind, SamplingParams
from libs.engine.sessions import SessionError, SessionRef
from libs.engine.streams import RequestStream
from libs.engine.tokenizer import Tokenizer
from libs.structured_output import StructuredOutput

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop stopped on an internal error; every open stream receives it."""


# The engine thread's inbox: one command per thing the event loop asks, handled between steps.


@dataclass(frozen=True)
class AddRequest:
    """Hand a prepared request to the scheduler; with `stream_interval` N > 1 its outputs are held
    back until they carry N new tokens."""

    request: Request
    stream_interval: int


@dataclass(frozen=True)
class AbortRequest:
    """Stop a request and free its KV blocks."""

    request_id: str


@dataclass(frozen=True)
class CallInEngine:
    """Run `fn` on the LLMEngine and settle `future` with its result or its exception."""

    fn: Callable[[LLMEngine], Any]
    future: asyncio.Future[Any]


EngineCommand = AddRequest | AbortRequest | CallInEngine


class AsyncLLMEngine:
    """Asyncio front of an LLMEngine: `generate()` streams a request's outputs, `abort()` stops it."""

    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine], max_pending: int = 64) -> None:
        """`engine` is a built LLMEngine, or a function that builds one: then `start()` builds it on
        the engine thread (the way to keep all of torch's work on one thread, see above)."""
        self.engine: LLMEngine | None = engine if isinstance(engine, LLMEngine) else None
        self._build = None if isinstance(engine, LLMEngine) else engine
        self.max_pending = max_pending  # outputs a stream holds before it merges them
        self._inbox: queue.SimpleQueue[EngineCommand] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, RequestStream] = {}
        # Engine thread only: the stream interval of requests that have one, and their held outputs.
        self._intervals: dict[str, tuple[int, OutputKind, int]] = {}  # (interval, kind, tokens sent)
        self._held: dict[str, RequestOutput] = {}
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self._sessions_checked = 0.0  # engine thread: when idle sessions were last looked at
        self._dead: BaseException | None = None
        self._stats: EngineStats | None = self.engine.get_stats() if self.engine is not None else None
        self._model_info: ModelInfo | None = self.engine.model_info if self.engine is not None else None
        # Published by the engine thread, like the stats: what the fleet's heartbeat reports must
        # never wait for a model step (a long prefill holds the engine thread for seconds).
        self._holdings: ExpertHoldings | None = (
            self.engine.expert_holdings() if self.engine is not None else None
        )

    @classmethod
    def from_pretrained(cls, model: str, *, max_pending: int = 64, **overrides: Any) -> AsyncLLMEngine:
        """An engine that loads `model` on its own thread when started; the settings are those of
        `LLMEngine.from_pretrained` (dtype a torch.dtype or its name) and are checked here, at once."""
        return cls.from_config(LLMEngine.pretrained_config(model, **overrides), max_pending=max_pending)

    @classmethod
    def from_config(cls, config: EngineConfig, *, max_pending: int = 64) -> AsyncLLMEngine:
        """An engine built from `config` on its own thread when started."""
        return cls(lambda: LLMEngine(config), max_pending)

    @property
    def tokenizer(self) -> Tokenizer:
        if self.engine is None:
            raise RuntimeError("AsyncLLMEngine.start() has not been awaited (the engine is not built)")
        return self.engine.tokenizer

    @property
    def model_info(self) -> ModelInfo:
        """The model served and the engine's limits (fixed once built: readable from any thread)."""
        if self._model_info is None:
            raise RuntimeError("AsyncLLMEngine.start() has not been awaited (the engine is not built)")
        return self._model_info

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    async def start(self) -> None:
        """Start the engine thread, building the engine there first if it was given as a function
        (idempotent). Call from the event loop that will read outputs; a build error is raised here."""
        if self.is_running:
            return
        self._loop = asyncio.get_running_loop()
        self._stopping = False
        started = self._loop.create_future()
        self._thread = threading.Thread(target=self._run, args=(started,), name="engine-loop", daemon=True)
        self._thread.start()
        try:
            await started
        except asyncio.CancelledError:
            # Stopped while building (loading the model, compiling the kernels: up to minutes):
            # nobody waits for the build. The daemon thread ends by itself once it is done.
            self._stopping = True
            raise
        except BaseException:
            await self._loop.run_in_executor(None, self._thread.join)
            self._thread = None
            raise

    async def shutdown(self) -> None:
        """Abort everything in flight and stop the engine thread."""
        if self._thread is None:
            return
        self._stopping = True
        self._wake.set()
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        self._thread = None

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        experts: ExpertSpec | None = None,
        stream_interval: int = 1,
        on_finished: Callable[[RequestOutput], None] | None = None,
        session: SessionRef | None = None,
        resume: Sequence[int] = (),
    ) -> RequestStream:
        """Validate and queue a request; its outputs arrive on the returned stream.

        With `stream_interval` N > 1, the engine thread holds a request's outputs back until they
        carry N new tokens (merged into one), and always delivers the last: a caller that does not
        show tokens as they come then does not wake the event loop at every step.

        `on_finished` is called on the event loop with the request's finished output when it reaches
        the stream, whether or not anyone reads the stream any more: once for every request that
        finishes, aborted ones (a cancelled caller, a deadline, shutdown) included.

        Raises InvalidRequestError (naming the field) or ExpertNotFoundError right away for bad input,
        SessionFullError for a session turn its session's token limit leaves no room for; a session
        turn the engine cannot take now (SessionLimitError, SessionBusyError) ends the stream with
        that error. `resume`: the output tokens an earlier run already gave the caller
        (RequestBuilder.build); the stream carries only what follows them.
        """
        if stream_interval < 1:
            raise InvalidRequestError("stream_interval", f"must be at least 1, got {stream_interval}")
        if self._dead is not None:
            raise EngineDeadError(f"engine loop failed: {self._dead}")
        if not self.is_running:
            raise RuntimeError("AsyncLLMEngine.start() has not been awaited")
        if request_id in self._streams:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        request = self.engine.prepare_request(
            request_id, prompt, params, priority=priority, experts=experts, session=session, resume=resume
        )
        stream = RequestStream(request_id, request.params.output_kind, self.max_pending, on_finished)
        self._streams[request_id] = stream
        self._send(AddRequest(request, stream_interval))
        return stream

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        experts: ExpertSpec | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs; leaving the iteration early (or being cancelled) aborts it."""
        request_id = request_id or uuid.uuid4().hex
        stream = self.add_request(request_id, prompt, params, priority=priority, experts=experts)
        try:
            async for output in stream:
                yield output
        finally:
            if not stream.finished:
                self.abort(request_id)

    async def compile_structured(self, structured: StructuredOutput | None) -> None:
        """Compile a structured output format into the engine's cache on an executor thread, so
        that `add_request` finds it compiled: a slow schema then holds neither the engine thread
        nor the event loop. Raises InvalidRequestError naming `structured` when it cannot be."""
        if structured is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.engine.grammars.compile, structured)

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its KV blocks; its stream ends with a finish_reason "abort" output.
        False when the request is not running (finished, or unknown)."""
        if request_id not in self._streams:
            return False
        self._send(AbortRequest(request_id))
        return True

    def get_stats(self) -> EngineStats:
        """The snapshot the engine thread took after its latest step."""
        if self._stats is None:
            raise RuntimeError("AsyncLLMEngine.start() has not been awaited")
        return self._stats

    def load(self) -> EngineLoad:
        """How busy the engine is, from the snapshot of its latest step, against its limits."""
        return EngineLoad.of(self.get_stats(), self.model_info)

    async def load_expert(
        self, source: bytes | str | os.PathLike[str], trusted_keys_dir: str | os.PathLike[str] | None = None
    ) -> tuple[str, str]:
        """LLMEngine.load_expert, run on the engine thread between steps."""
        return await self._call(lambda engine: engine.load_expert(source, trusted_keys_dir))

    async def end_session(self, session_id: str) -> bool:
        """LLMEngine.end_session, run on the engine thread between steps."""
        return await self._call(lambda engine: engine.end_session(session_id))

    async def unload_expert(self, name: str) -> None:
        await self._call(lambda engine: engine.unload_expert(name))

    async def list_experts(self) -> list[ExpertInfo]:
        return await self._call(lambda engine: engine.list_experts())

    async def expert_holdings(self) -> ExpertHoldings:
        """The experts held, as the engine thread published them after its latest change: at once,
        whatever step is running (a call that changed them, such as load_expert, is reflected by
        the time it returns)."""
        if self._holdings is None:
            raise RuntimeError("AsyncLLMEngine.start() has not been awaited")
        return self._holdings

    async def _call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run `fn(engine)` on the engine thread (the engine is single-threaded)."""
        if not self.is_running:
            raise RuntimeError("AsyncLLMEngine.start() has not been awaited")
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._send(CallInEngine(fn, future))
        return await future

    def _send(self, command: EngineCommand) -> None:
        self._inbox.put(command)
        self._wake.set()

    # -- engine thread -------------------------------------------------------------------------

    def _deliver(self, request_id: str, item: RequestOutput | BaseException, final: bool) -> None:
        self._deliver_all([(request_id, item, final)])

    def _deliver_all(self, items: list[tuple[str, RequestOutput | BaseException, bool]]) -> None:
        """Hand items to their streams on the event loop: one wake-up of the loop thread for a whole
        step's outputs, which on a machine whose cores the model's threads keep busy is what it costs."""

        def put() -> None:
            for request_id, item, final in items:
                stream = self._streams.get(request_id)
                if stream is not None:
                    stream.deliver(item)
                    if final:
                        del self._streams[request_id]

        if items and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(put)

    def _ready(self, outputs: list[RequestOutput]) -> list[tuple[str, RequestOutput, bool]]:
        """The step's outputs to deliver now: those of a request with a stream interval are merged
        and held back until they carry that many new tokens, or the request finished."""
        ready = []
        for output in outputs:
            request_id = output.request_id
            holding = self._intervals.get(request_id)
            if holding is not None:
                interval, kind, sent = holding
                held = self._held.pop(request_id, None)
                if held is not None:
                    output = merge_outputs(held, output, kind)
                made = len(output.outputs[0].token_ids)  # all so far, or (DELTA) all since the last
                new = made - sent if kind == OutputKind.CUMULATIVE else made
                if not output.finished and new < interval:
                    self._held[request_id] = output
                    continue
                if output.finished:
                    del self._intervals[request_id]
                elif kind == OutputKind.CUMULATIVE:
                    self._intervals[request_id] = (interval, kind, made)
            ready.append((request_id, output, output.finished))
        return ready

    def _drain_inbox(self) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            match command:
                case AddRequest(request, stream_interval):
                    self._add(request, stream_interval)
                case AbortRequest(request_id):
                    self.engine.abort_request(request_id)
                case CallInEngine(fn, future):
                    self._run_call(fn, future)

    def _add(self, request: Request, stream_interval: int) -> None:
        try:
            self.engine.enqueue(request)
        except (InvalidRequestError, ExpertError, SessionError) as exc:
            self._deliver(request.request_id, exc, final=True)
            return
        if stream_interval > 1:
            self._intervals[request.request_id] = (stream_interval, request.params.output_kind, 0)

    def _expire_sessions(self) -> None:
        """End the sessions idle past their timeout, checked about once a second (the loop wakes at
        least every half second when idle)."""
        now = time.monotonic()
        if now - self._sessions_checked >= 1.0:
            self._sessions_checked = now
            for session_id in self.engine.expire_sessions():
                log.info("session %s ended: idle past its timeout", session_id)

    def _run_call(self, fn: Callable[[LLMEngine], Any], future: asyncio.Future) -> None:
        try:
            result, error = fn(self.engine), None
        except Exception as exc:  # handed to the awaiting caller
            result, error = None, exc
        self._publish_holdings()  # before the caller resumes: it sees what its call changed
        self._settle(future, result, error)

    def _publish_holdings(self) -> None:
        """Engine thread: publish the experts held when they changed (the epoch grows with each
        change, so an unchanged engine costs one comparison per step)."""
        if self._holdings is None or self._holdings.epoch != self.engine.experts.epoch:
            self._holdings = self.engine.expert_holdings()

    def _settle(self, future: asyncio.Future, result: Any = None, error: BaseException | None = None) -> None:
        """Complete an event-loop future from the engine thread."""

        def settle() -> None:
            if future.done():
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)

        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(settle)

    def _run(self, started: asyncio.Future) -> None:
        try:
            if self.engine is None:
                self.engine = self._build()
            self._model_info = self.engine.model_info
            self._stats = self.engine.get_stats()
            self._publish_holdings()
        except Exception as exc:
            self._settle(started, error=exc)
            return
        self._settle(started)
        engine = self.engine
        try:
            while not self._stopping:
                self._drain_inbox()
                self._expire_sessions()
                if not engine.has_unfinished_requests():
                    self._stats = engine.get_stats()
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                self._deliver_all(self._ready(engine.step()))
                self._stats = engine.get_stats()
                self._publish_holdings()  # a step may load or evict experts for its requests
            # Shutting down: end every open request as aborted.
            self._drain_inbox()
            engine.abort_request(engine.unfinished_request_ids())
            ending = self._ready(engine.step())
            self._deliver_all([(request_id, output, True) for request_id, output, _ in ending])
        except BaseException as exc:
            log.exception("engine loop failed")
            self._dead = exc
            error = EngineDeadError(f"engine loop failed: {type(exc).__name__}: {exc}")
            for request_id in list(self._streams):
                self._deliver(request_id, error, final=True)
