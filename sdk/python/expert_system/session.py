"""Sessions: multi-turn conversations whose history stays on one engine between turns (the
reception's SessionService, docs/api.md#sessions).

```python
with client.session(system_prompt="You answer briefly.", temperature=0.0, max_new_tokens=64) as session:
    session.append("What is a lighthouse?")
    stream = session.generate()
    for chunk in stream:
        if chunk.restarted:  # the turn moved to another engine: discard what was printed
            print("\\n[restarted]")
        print(chunk.text, end="", flush=True)
    stream.end.finish_reason, stream.end.usage.cached_tokens, stream.end.session.turns
```

Each turn sends only what is new: `append` a user message (or chat messages), then `generate` the
reply. `generate` with nothing appended goes on with a reply that was cut (finish_reason "length",
or "abort" after `cancel`). `cancel` stops the running turn, keeping what it generated; `end` (or
leaving the `with` block) frees what the session holds. A session unused for a while expires:
calls on it then raise `NotFound`, as on one that ended.

A turn may offer tools, as `infer` takes them: `session.generate(tools=[...], tool_choice=...)`;
a reply that calls ends with `stream.end.tool_calls`, and each result goes back as a tool message,
`session.append([{"role": "tool", "tool_call_id": call.id, "content": "..."}])`, before the next
`generate`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal, TypedDict, Unpack

import grpc

from ._proto.expert.v1 import common_pb2, session_pb2, session_pb2_grpc
from .connection import DEFAULT_TIMEOUT
from .errors import ExpertSystemError, NotFound, error_from_aio_call, error_from_call
from .request import ChatMessageDict, _chat_message, _set, _set_repeated, build_request
from .results import (
    AppliedExpert,
    FinishReasonName,
    StreamChunk,
    _datetime,
    _enum_names,
    applied_expert_from_proto,
    finish_reason_name,
)
from .stream import AsyncInferStream, InferStream
from .tools import ToolCall, tool_call_from_proto, tool_choice_into, tools_into

SessionStateName = Literal["unspecified", "idle", "generating", "ended"]
_SESSION_STATE = _enum_names(session_pb2.SessionState, "SESSION_STATE_")


class SamplingFields(TypedDict, total=False):
    """A session's sampling settings: its defaults (`client.session(...)`), or one turn's
    overrides (`session.generate(...)`). Left out: the session's default, else the router's."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    # Up to 16 stop strings (a turn's replace the session's).
    stop: Sequence[str]
    seed: int
    # Tokens a reply may have at most.
    max_new_tokens: int


class SessionFields(SamplingFields, total=False):
    """The keywords of `client.session(...)`: the session's settings, fixed for its whole life."""

    # The base model (as the fleet names it); unset: the fleet's default.
    model: str
    force_experts: Sequence[str]
    exclude_experts: Sequence[str]
    max_experts: int
    system_prompt: str
    # 0-9, default 5; higher is served first.
    priority: int
    # A first input, as `append` takes it.
    messages: Sequence[ChatMessageDict]


class TurnFields(SamplingFields, total=False):
    """The keywords of `session.generate(...)`: sampling overrides, a format for this reply (as
    `infer` takes it: `response_format`, `regex` or `grammar`) and the turn's time limit."""

    response_format: Mapping[str, Any]
    regex: str
    grammar: str
    # Longest the turn may take; on expiry it ends with what it generated.
    timeout_ms: int
    # Functions the model may call in this turn, as `infer` takes them (expert_system.tools).
    tools: Sequence[Mapping[str, Any]]
    tool_choice: str | Mapping[str, Any]
    parallel_tool_calls: bool


def _keys(fields: type) -> frozenset[str]:
    return frozenset(fields.__required_keys__ | fields.__optional_keys__)


_SAMPLING_NAMES = _keys(SamplingFields)
_SESSION_NAMES = _keys(SessionFields)
_TURN_NAMES = _keys(TurnFields)
_FORMAT_NAMES = ("response_format", "regex", "grammar")


@dataclass(frozen=True)
class ExpertRef:
    """An expert a session's first turn fixed for the session."""

    name: str
    version: str
    weight: float


@dataclass(frozen=True)
class SessionInfo:
    """A session as the server holds it. `state` is "idle", "generating" or "ended"; `tokens` the
    conversation's length (its KV on the engine); `engine_id` and `experts` are set by the first
    turn; `last_finish_reason` is how the last turn ended ("unspecified" before any); `job_id` the
    running turn's job while "generating"."""

    session_id: str
    state: SessionStateName
    turns: int
    tokens: int
    engine_id: str
    experts: tuple[ExpertRef, ...]
    model: str
    pending_messages: int
    created_at: datetime | None
    last_used_at: datetime | None
    idle_seconds: float
    expires_at: datetime | None
    last_finish_reason: FinishReasonName
    job_id: str


@dataclass(frozen=True)
class TurnUsage:
    """A turn's tokens and time: `prompt_tokens` is the conversation's length at the turn's start,
    of which `cached_tokens` were already on the engine (so it computed the difference)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    queue_ms: float
    ttft_ms: float
    decode_ms: float


@dataclass(frozen=True)
class TurnEnd:
    """How a turn ended: its whole reply, `finish_reason` ("stop", "length", "abort" after a
    cancel, "timeout", "error"), `error` when it failed or hit its time limit, and `session` the
    session after it (None, as `usage`, when the session ended meanwhile)."""

    job_id: str
    finish_reason: FinishReasonName
    text: str
    usage: TurnUsage | None
    experts: tuple[AppliedExpert, ...]
    session: SessionInfo | None
    error: str
    # The calls the reply made (finish_reason "tool_calls"): answer each with a tool message,
    # `session.append({"role": "tool", "tool_call_id": call.id, "content": ...})`.
    tool_calls: tuple[ToolCall, ...] = ()


def session_info_from_proto(message: session_pb2.Session) -> SessionInfo:
    return SessionInfo(
        session_id=message.session_id,
        state=_SESSION_STATE.get(message.state, str(message.state)),
        turns=message.turns,
        tokens=message.tokens,
        engine_id=message.engine_id,
        experts=tuple(ExpertRef(e.name, e.version, e.weight) for e in message.experts),
        model=message.model,
        pending_messages=message.pending_messages,
        created_at=_datetime(message, "created_at"),
        last_used_at=_datetime(message, "last_used_at"),
        idle_seconds=message.idle_seconds,
        expires_at=_datetime(message, "expires_at"),
        last_finish_reason=finish_reason_name(message.last_finish_reason),
        job_id=message.job_id,
    )


def turn_end_from_proto(message: session_pb2.TurnEnd) -> TurnEnd:
    usage = message.usage
    return TurnEnd(
        job_id=message.job_id,
        finish_reason=finish_reason_name(message.finish_reason),
        text=message.text,
        usage=TurnUsage(
            usage.prompt_tokens,
            usage.completion_tokens,
            usage.cached_tokens,
            usage.queue_ms,
            usage.ttft_ms,
            usage.decode_ms,
        )
        if message.HasField("usage")
        else None,
        experts=tuple(applied_expert_from_proto(e) for e in message.experts),
        session=session_info_from_proto(message.session) if message.HasField("session") else None,
        error=message.error,
        tool_calls=tuple(tool_call_from_proto(c) for c in message.tool_calls),
    )


def _check_keywords(caller: str, fields: Mapping[str, Any], allowed: frozenset[str]) -> None:
    for name in fields:
        if name not in allowed:
            raise TypeError(f"{caller}() got an unexpected keyword argument '{name}'")


def _strings(value: str | Sequence[str]) -> list[str]:
    return [value] if isinstance(value, str) else list(value)  # a lone string is one item


def _sampling(fields: Mapping[str, Any]) -> session_pb2.SessionSampling:
    sampling = session_pb2.SessionSampling()
    for name, value in fields.items():
        if value is None or name not in _SAMPLING_NAMES:
            continue
        if name == "stop":
            _set_repeated(sampling, name, _strings(value))
        else:
            _set(sampling, name, value)
    return sampling


def create_request(settings: Mapping[str, Any]) -> session_pb2.CreateSessionRequest:
    """The CreateSessionRequest for `client.session(**settings)`; a keyword left out (or None)
    stays unset. An unknown keyword raises TypeError, a bad value TypeError or ValueError, each
    naming the keyword."""
    _check_keywords("session", settings, _SESSION_NAMES)
    request = session_pb2.CreateSessionRequest(sampling=_sampling(settings))
    for name, value in settings.items():
        if value is None or name in _SAMPLING_NAMES:
            continue
        if name == "messages":
            request.messages.extend(_chat_message(i, m) for i, m in enumerate(value))
        elif name in ("force_experts", "exclude_experts"):
            _set_repeated(request, name, _strings(value))
        else:
            _set(request, name, value)
    return request


def append_request(session_id: str, input: str | Sequence[ChatMessageDict]) -> session_pb2.AppendInputRequest:
    """A str is one user message; chat messages ({"role", "content"}, roles user, system or tool)
    are appended in order."""
    if isinstance(input, str):
        return session_pb2.AppendInputRequest(session_id=session_id, text=input)
    if isinstance(input, Mapping):  # one message
        input = [input]
    if not isinstance(input, Sequence):
        raise TypeError(f"append: expected a str or a list of messages, got {type(input).__name__}")
    messages = [_chat_message(i, m) for i, m in enumerate(input)]
    return session_pb2.AppendInputRequest(
        session_id=session_id, conversation=common_pb2.Conversation(messages=messages)
    )


def generate_request(session_id: str, fields: Mapping[str, Any]) -> session_pb2.GenerateStreamRequest:
    """The GenerateStreamRequest for `session.generate(**fields)`."""
    _check_keywords("generate", fields, _TURN_NAMES)
    request = session_pb2.GenerateStreamRequest(session_id=session_id, sampling=_sampling(fields))
    formats = {name: fields[name] for name in _FORMAT_NAMES if fields.get(name) is not None}
    if formats:  # checked and built as `infer` builds them
        built = build_request("generate", "", formats)
        if built.HasField("response_format"):
            request.response_format.CopyFrom(built.response_format)
    if fields.get("timeout_ms") is not None:
        _set(request, "timeout_ms", fields["timeout_ms"])
    _turn_tools(request, fields)
    return request


def _turn_tools(request: session_pb2.GenerateStreamRequest, fields: Mapping[str, Any]) -> None:
    """The turn's tools, tool_choice and parallel_tool_calls, built as `infer` builds them."""
    if fields.get("tools") is not None:
        tools_into(request, fields["tools"])
    if fields.get("tool_choice") is not None:
        tool_choice_into(request, fields["tool_choice"])
    if fields.get("parallel_tool_calls") is not None:
        _set(request, "parallel_tool_calls", fields["parallel_tool_calls"])


class _TurnEvents:
    """The events of GenerateStream as chunks, for the iteration of `InferStream` (which this
    extends): `result` (also `end`) is the `TurnEnd`."""

    result: TurnEnd | None

    @property
    def end(self) -> TurnEnd | None:
        """How the turn ended, once the iteration is over."""
        return self.result

    def _apply(self, response: session_pb2.GenerateStreamResponse) -> StreamChunk | None:
        event = response.WhichOneof("event")
        if event == "text":
            return StreamChunk(text=response.text)
        if event == "restarted_attempt":
            self.restarts += 1
            return StreamChunk(text="", restarted=True, attempt=response.restarted_attempt)
        if event == "end":
            self.result = turn_end_from_proto(response.end)
            self.job_id = self.result.job_id
        return None  # an event this SDK does not know yet is skipped

    def _ended_without_result(self) -> ExpertSystemError:
        return ExpertSystemError("UNKNOWN", "the stream ended without the turn's end")


class TurnStream(_TurnEvents, InferStream):
    """A turn's reply: iterate for `StreamChunk`s (`text`; `restarted=True`: the turn moved to
    another engine and the text so far is void), then read `end`. Iterate once; the call starts
    when the iteration does, and leaving the loop early (or `cancel()`) closes it, which stops the
    turn with what it generated. `session.cancel()` stops it too, and waits until the session can
    take the next call."""


class AsyncTurnStream(_TurnEvents, AsyncInferStream):
    """`TurnStream` for asyncio: `async for chunk in stream`, then `stream.end`."""


def _unary(method: Callable[..., Any], request, timeout: float | None, metadata) -> Any:
    try:
        return method(request, timeout=timeout, metadata=metadata)
    except grpc.RpcError as exc:
        raise error_from_call(exc) from None


async def _aio_unary(method: Callable[..., Any], request, timeout: float | None, metadata) -> Any:
    call = method(request, timeout=timeout, metadata=metadata)
    try:
        return await call
    except grpc.aio.AioRpcError:
        raise await error_from_aio_call(call) from None


class Session:
    """A session on the reception, made by `ExpertClient.session(...)` (which creates it at once).

    As a context manager it ends the session on exit (one that ended or expired already is fine).
    The quick calls take `timeout` (seconds, default 10); `generate`'s `timeout` is its call's
    deadline (none by default; `timeout_ms` is the turn's own limit). A failed call raises an
    `ExpertSystemError`: `NotFound` for a session that ended or expired, `FailedPrecondition` for a
    turn already running, nothing to answer or the session's token limit, `ResourceExhausted` for
    an engine holding all the sessions it can.
    """

    def __init__(
        self,
        channel: grpc.Channel,
        metadata: tuple[tuple[str, str], ...],
        settings: Mapping[str, Any],
        timeout: float | None = DEFAULT_TIMEOUT,
    ) -> None:
        request = create_request(settings)
        self._stub = session_pb2_grpc.SessionServiceStub(channel)
        self._metadata = metadata
        self._ended = False
        response = _unary(self._stub.CreateSession, request, timeout, metadata)
        self.session_id: str = response.session.session_id

    def append(
        self, input: str | Sequence[ChatMessageDict], *, timeout: float | None = DEFAULT_TIMEOUT
    ) -> SessionInfo:
        """Append a user message (a str) or chat messages for the next `generate` to answer."""
        request = append_request(self.session_id, input)
        return session_info_from_proto(self._call(self._stub.AppendInput, request, timeout).session)

    def generate(self, *, timeout: float | None = None, **fields: Unpack[TurnFields]) -> TurnStream:
        """Generate the reply to what was appended (or, with nothing appended, go on with a reply
        that was cut): iterate the returned `TurnStream`, then read its `end`."""
        request = generate_request(self.session_id, fields)
        return TurnStream(
            lambda: self._stub.GenerateStream(request, timeout=timeout, metadata=self._metadata)
        )

    def cancel(self, *, timeout: float | None = DEFAULT_TIMEOUT) -> bool:
        """Stop the running turn, keeping what it generated; returns once the session is idle.
        False when no turn was running."""
        request = session_pb2.CancelGenerateRequest(session_id=self.session_id)
        return self._call(self._stub.CancelGenerate, request, timeout).cancelled

    def info(self, *, timeout: float | None = DEFAULT_TIMEOUT) -> SessionInfo:
        """The session as the server holds it now."""
        request = session_pb2.GetSessionRequest(session_id=self.session_id)
        return session_info_from_proto(self._call(self._stub.GetSession, request, timeout).session)

    def end(self, *, timeout: float | None = DEFAULT_TIMEOUT) -> SessionInfo:
        """End the session (stopping a running turn) and free what it holds; returns it as it
        ended."""
        request = session_pb2.EndSessionRequest(session_id=self.session_id)
        session = self._call(self._stub.EndSession, request, timeout).session
        self._ended = True
        return session_info_from_proto(session)

    def _call(self, method: Callable[..., Any], request, timeout: float | None) -> Any:
        return _unary(method, request, timeout, self._metadata)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, exc_type, *exc_info) -> None:
        if self._ended:
            return
        try:
            self.end()
        except NotFound:
            pass
        except ExpertSystemError:
            if exc_type is None:  # never hide the exception that left the block
                raise


class AsyncSession:
    """`Session` for asyncio, made by `AsyncExpertClient.session(...)`: it is created on
    `async with client.session(...) as session:` (which ends it on exit) or by awaiting it,
    `session = await client.session(...)`. Its calls are awaited; `generate` returns an
    `AsyncTurnStream` for `async for`."""

    def __init__(
        self,
        channel: grpc.aio.Channel,
        metadata: tuple[tuple[str, str], ...],
        settings: Mapping[str, Any],
        timeout: float | None = DEFAULT_TIMEOUT,
    ) -> None:
        self._request = create_request(settings)  # a bad keyword is an error at once
        self._timeout = timeout
        self._stub = session_pb2_grpc.SessionServiceStub(channel)
        self._metadata = metadata
        self._ended = False
        self._session_id: str | None = None

    @property
    def session_id(self) -> str:
        if self._session_id is None:
            raise RuntimeError(
                "the session is not created yet: `async with client.session(...)` or "
                "`await client.session(...)`"
            )
        return self._session_id

    async def create(self) -> AsyncSession:
        """Create the session on the server (once; later calls return it as is)."""
        if self._session_id is None:
            response = await self._call(self._stub.CreateSession, self._request, self._timeout)
            self._session_id = response.session.session_id
        return self

    def __await__(self):
        return self.create().__await__()

    async def append(
        self, input: str | Sequence[ChatMessageDict], *, timeout: float | None = DEFAULT_TIMEOUT
    ) -> SessionInfo:
        """Append a user message (a str) or chat messages for the next `generate` to answer."""
        request = append_request(self.session_id, input)
        return session_info_from_proto((await self._call(self._stub.AppendInput, request, timeout)).session)

    def generate(self, *, timeout: float | None = None, **fields: Unpack[TurnFields]) -> AsyncTurnStream:
        """Generate the reply (see `Session.generate`): `async for chunk in stream`, then `stream.end`."""
        request = generate_request(self.session_id, fields)
        return AsyncTurnStream(
            lambda: self._stub.GenerateStream(request, timeout=timeout, metadata=self._metadata)
        )

    async def cancel(self, *, timeout: float | None = DEFAULT_TIMEOUT) -> bool:
        """Stop the running turn, keeping what it generated; False when none was running."""
        request = session_pb2.CancelGenerateRequest(session_id=self.session_id)
        return (await self._call(self._stub.CancelGenerate, request, timeout)).cancelled

    async def info(self, *, timeout: float | None = DEFAULT_TIMEOUT) -> SessionInfo:
        """The session as the server holds it now."""
        request = session_pb2.GetSessionRequest(session_id=self.session_id)
        return session_info_from_proto((await self._call(self._stub.GetSession, request, timeout)).session)

    async def end(self, *, timeout: float | None = DEFAULT_TIMEOUT) -> SessionInfo:
        """End the session and free what it holds; returns it as it ended."""
        request = session_pb2.EndSessionRequest(session_id=self.session_id)
        session = (await self._call(self._stub.EndSession, request, timeout)).session
        self._ended = True
        return session_info_from_proto(session)

    async def _call(self, method: Callable[..., Any], request, timeout: float | None) -> Any:
        return await _aio_unary(method, request, timeout, self._metadata)

    async def __aenter__(self) -> AsyncSession:
        return await self.create()

    async def __aexit__(self, exc_type, *exc_info) -> None:
        if self._ended or self._session_id is None:
            return
        try:
            await self.end()
        except NotFound:
            pass
        except ExpertSystemError:
            if exc_type is None:
                raise
