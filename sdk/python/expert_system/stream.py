"""Streamed jobs: the events of `InferStream` turned into text chunks, plus what they reported.

The server sends, in order: `submitted` (the job id), deltas (each of one choice, named by its
`index`: new text, and with tools new pieces of its calls) and status changes, and the
result. A `restarted_attempt` event means the job started over (its dispatcher died or its engine
failed): it is yielded as an empty chunk with `restarted=True`, and everything yielded before it
is void. Leaving the loop early (break, an exception, Ctrl-C) cancels the call, and the server
then cancels the job.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator

import grpc

from ._proto.expert.v1 import inference_pb2
from .errors import ExpertSystemError, error_from_aio_call, error_from_call
from .results import (
    InferenceResult,
    JobSubmission,
    StreamChunk,
    job_status_name,
    result_from_proto,
    submission_from_proto,
    token_logprob_from_proto,
)
from .tools import tool_call_delta_from_proto


class _StreamState:
    """What the events of one stream said so far; shared by the sync and async iterators."""

    def __init__(self) -> None:
        self.job_id: str | None = None
        self.submission: JobSubmission | None = None
        # The last status event, e.g. "running".
        self.status: str | None = None
        self.result: InferenceResult | None = None
        self.restarts = 0
        self._started = False

    def _start(self) -> None:
        if self._started:
            raise RuntimeError("a stream can be iterated only once")
        self._started = True

    def _apply(self, response: inference_pb2.InferStreamResponse) -> StreamChunk | None:
        """Record one event; return the chunk to yield, if any."""
        event = response.WhichOneof("event")
        if event == "submitted":
            self.submission = submission_from_proto(response.submitted)
            self.job_id = self.submission.job_id
            self.status = self.submission.status
        elif event == "status":
            self.status = job_status_name(response.status)
        elif event == "delta":
            delta = response.delta
            logprobs = tuple(token_logprob_from_proto(t) for t in delta.logprobs)
            calls = tuple(tool_call_delta_from_proto(c) for c in delta.tool_calls)
            return StreamChunk(text=delta.text, index=delta.index, logprobs=logprobs, tool_calls=calls)
        elif event == "restarted_attempt":
            self.restarts += 1
            return StreamChunk(text="", restarted=True, attempt=response.restarted_attempt)
        elif event == "result":
            self.result = result_from_proto(response.result)
            self.job_id = self.job_id or self.result.job_id
            self.status = self.result.status
        # An event this SDK does not know yet is skipped.
        return None

    def _ended_without_result(self) -> ExpertSystemError:
        return ExpertSystemError("UNKNOWN", "the stream ended without a result")


class InferStream(_StreamState):
    """Iterate to receive `StreamChunk`s; afterwards `result` holds the `InferenceResult`.

    `job_id` is known once the server accepted the job. Iterate once; `cancel()` (or leaving the
    loop early) stops the call. Also a context manager that cancels an unfinished stream on exit.
    """

    def __init__(self, start: Callable[[], grpc.Call]) -> None:
        super().__init__()
        self._start_call = start
        self._call: grpc.Call | None = None

    def __iter__(self) -> Iterator[StreamChunk]:
        self._start()
        call = self._call = self._start_call()
        try:
            for response in call:
                if self.result is not None:  # the server closes the stream right after the result
                    continue
                chunk = self._apply(response)
                if chunk is not None:
                    yield chunk
        except grpc.RpcError as exc:
            if self.result is None:
                raise error_from_call(exc) from None
        finally:
            if self.result is None:
                call.cancel()
        if self.result is None:
            raise self._ended_without_result()

    def cancel(self) -> None:
        """Stop the call (and so the job) unless it already finished."""
        if self._call is not None and self.result is None:
            self._call.cancel()

    def __enter__(self) -> InferStream:
        return self

    def __exit__(self, *exc_info) -> None:
        self.cancel()


class AsyncInferStream(_StreamState):
    """The asyncio `InferStream`: `async for chunk in stream`, then `stream.result`.

    Breaking out of `async for` cancels the call when the loop finalises the iterator; use
    `async with` or `await stream.cancel()` to cancel at a known point.
    """

    def __init__(self, start: Callable[[], grpc.aio.UnaryStreamCall]) -> None:
        super().__init__()
        self._start_call = start
        self._call: grpc.aio.UnaryStreamCall | None = None

    async def __aiter__(self) -> AsyncIterator[StreamChunk]:
        self._start()
        call = self._call = self._start_call()
        try:
            async for response in call:
                if self.result is not None:
                    continue
                chunk = self._apply(response)
                if chunk is not None:
                    yield chunk
        except grpc.aio.AioRpcError:
            if self.result is None:
                raise await error_from_aio_call(call) from None
        finally:
            if self.result is None:
                call.cancel()
        if self.result is None:
            raise self._ended_without_result()

    async def cancel(self) -> None:
        """Stop the call (and so the job) unless it already finished."""
        if self._call is not None and self.result is None:
            self._call.cancel()

    async def __aenter__(self) -> AsyncInferStream:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.cancel()
