"""A streamed completions request with several prompts: one job per prompt (as completion_prompts.py
runs them), their chunks interleaved as they come, as OpenAI streams them. Each chunk names its
choice by its index in the answer (prompt k's choice c is k * n + c) and carries the first job's id;
after every choice's finish chunk come one usage chunk (summed over the jobs, if asked for) and
`data: [DONE]`. A refusal at admission is the HTTP answer (the jobs admitted before it are
cancelled); a failure after the stream started is one error event, and ends the other jobs."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse

from libs.gen.expert.v1 import common_pb2
from services.reception.admission.core import Admission
from services.reception.http.completion_prompts import for_prompt, summed
from services.reception.http.errors import HttpError, ToHttpError, error_response
from services.reception.http.openai_response import Chunks, event, failure, usage
from services.reception.http.openai_schema import CompletionRequest
from services.reception.job_events import Delta, Finished, JobEvent, Restarted

_ENDED = object()  # a job's events are over


async def stream_prompts(
    admission: Admission,
    body: CompletionRequest,
    inferences: list[common_pb2.InferenceRequest],
    to_http_error: ToHttpError,
) -> StreamingResponse | JSONResponse:
    """Admit each prompt's job, then stream their chunks; the first refusal is the answer."""
    streams = [admission.stream(inference) for inference in inferences]
    job_ids = []
    for k, events in enumerate(streams):
        try:
            job_ids.append((await anext(events)).submission.job_id)  # admission: a refusal raises
        except Exception as exc:
            for admitted in streams:
                await admitted.aclose()  # closing a stream cancels its job
            return error_response(for_prompt(to_http_error(exc, body), k))
    n = inferences[0].n or 1
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    chunks = [
        Chunks(job_ids[0], body, False, include_usage, n, first_index=k * n) for k in range(len(streams))
    ]
    return StreamingResponse(
        _interleaved(streams, chunks, body, to_http_error),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache"},
    )


async def _interleaved(
    streams: list[AsyncIterator[JobEvent]], chunks: list[Chunks], body, to_http_error: ToHttpError
) -> AsyncIterator[str]:
    """The jobs' chunks in the order their events come. Closed early (the client went away), or
    after a failure, every stream is closed, which cancels the jobs still running."""
    queue: asyncio.Queue = asyncio.Queue()
    pumps = [asyncio.create_task(_pump(k, events, queue)) for k, events in enumerate(streams)]
    results: list[common_pb2.InferenceResult] = []
    try:
        live, sent = len(streams), set()
        while live:
            k, item = await queue.get()
            if item is _ENDED:
                live -= 1
                continue
            lines, error = _lines(k, item, chunks[k], sent, body, to_http_error)
            for line in lines:
                yield line
            if error is not None:
                yield event(for_prompt(error, k).body())
                return
            if isinstance(item, Finished):
                results.append(item.result)
        yield _closing(chunks[0], results)
    finally:
        for pump in pumps:
            pump.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        for events in streams:
            with contextlib.suppress(Exception):
                await events.aclose()


def _closing(chunks: Chunks, results: list[common_pb2.InferenceResult]) -> str:
    """The usage chunk (summed over the jobs) if asked for, and `data: [DONE]`, as one piece."""
    return "".join(chunks.closing(summed([usage(result) for result in results])))


def _lines(
    k: int, item: object, chunks: Chunks, sent: set[int], body, to_http_error: ToHttpError
) -> tuple[list[str], HttpError | None]:
    """The chunks of prompt k's event (or the error that ends the stream)."""
    match item:
        case Delta(delta) if delta.text or delta.logprobs or delta.tool_calls:
            sent.add(k)
            return chunks.delta(delta), None
        case Restarted() if k in sent:
            # The job started over on another engine: the text sent cannot be taken back.
            error = HttpError(
                503, "the job restarted after part of its output was streamed", code="job_restarted"
            )
            return [], error
        case Restarted():
            pass  # nothing of this prompt was sent yet: the new attempt's chunks are its answer
        case Finished(result):
            failed = failure(result, body)
            return ([], failed) if failed is not None else (list(chunks.finishes(result)), None)
        case BaseException():
            return [], to_http_error(item, body)
    return [], None


async def _pump(k: int, events: AsyncIterator[JobEvent], queue: asyncio.Queue) -> None:
    """Prompt k's events into `queue`, (k, event) each, then (k, _ENDED); a refusal as the event."""
    try:
        async for job_event in events:
            await queue.put((k, job_event))
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # a refusal at the end (e.g. an unknown forced expert)
        await queue.put((k, exc))
    await queue.put((k, _ENDED))
