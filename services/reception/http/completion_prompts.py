"""A completions request with several prompts (["a", "b"] or [[1, 2], [3]]): one job per prompt, run
together, each with the body's `n`; the answer lists each prompt's choices in turn, numbered as
OpenAI numbers them (prompt k's choice c is index k * n + c), with the usage summed. A refusal or
failure of any prompt's job is the answer (its other jobs are cancelled), its `param` naming the
prompt (`prompt[1]`, `prompt[1][4]` for a token id). Streamed (`stream: true`), the prompts' chunks
interleave, each naming its choice by that index (completion_streams.py)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from libs.gen.expert.v1 import common_pb2
from services.reception.admission.core import Admission
from services.reception.http.calls import unless_disconnected
from services.reception.http.errors import HttpError, ToHttpError, error_response
from services.reception.http.openai_request import prompts_of, set_prompt
from services.reception.http.openai_response import failure, response
from services.reception.http.openai_schema import CompletionRequest

MAX_PROMPTS = 16  # the jobs one request may queue at once (each with up to 16 choices)


def per_prompt(body: CompletionRequest, inference: common_pb2.InferenceRequest) -> list | None:
    """The request of each prompt when the body has several (copies of `inference`, the first
    prompt's); None for one prompt. Refuses more than MAX_PROMPTS, and a stream of several."""
    prompts = prompts_of(body)
    if len(prompts) == 1:
        return None
    if len(prompts) > MAX_PROMPTS:
        message = f"prompt: at most {MAX_PROMPTS} prompts in one request, got {len(prompts)}"
        raise HttpError(400, message, "prompt", "invalid_value")
    inferences = []
    for prompt in prompts:
        copy = common_pb2.InferenceRequest()
        copy.CopyFrom(inference)
        set_prompt(copy, prompt)
        inferences.append(copy)
    return inferences


async def complete_prompts(
    admission: Admission,
    request: Request,
    body: CompletionRequest,
    inferences: list[common_pb2.InferenceRequest],
    to_http_error: ToHttpError,
) -> dict[str, Any] | JSONResponse:
    """Each prompt's job; the merged answer, or the first refusal or failure among them."""
    tasks = [asyncio.create_task(_one(admission, request, i, body, to_http_error)) for i in inferences]
    try:
        pending = set(tasks)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                answer = task.result()
                if answer is None:
                    return JSONResponse({}, status_code=499)  # the client went away: nobody reads it
                if isinstance(answer, HttpError):
                    return error_response(for_prompt(answer, tasks.index(task)))
    finally:
        for task in tasks:
            task.cancel()  # a job still running once another failed (or the client left) is cancelled
        await asyncio.gather(*tasks, return_exceptions=True)
    logprobs = inferences[0].HasField("logprobs")
    answers = [response(task.result(), body, False, logprobs) for task in tasks]
    return merged(answers, inferences[0].n or 1)


async def _one(
    admission: Admission,
    request: Request,
    inference: common_pb2.InferenceRequest,
    body: CompletionRequest,
    to_http_error: ToHttpError,
) -> common_pb2.InferenceResult | HttpError | None:
    """One prompt's result, or its refusal or failure; None when the client hung up."""
    try:
        result = await unless_disconnected(request, admission.infer(inference))
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        return to_http_error(exc, body)
    if result is None:
        return None
    return failure(result, body) or result


def for_prompt(error: HttpError, index: int) -> HttpError:
    """The error with its `param` naming the prompt it is about (`prompt` -> `prompt[1]`)."""
    old = error.param
    if old is not None and old.startswith("prompt"):
        error.param = f"prompt[{index}]{old.removeprefix('prompt')}"
        if error.message.startswith(old):
            error.message = error.param + error.message.removeprefix(old)
    return error


def summed(usages: list[dict[str, Any]]) -> dict[str, Any]:
    """The usages' sum, field by field, into nested details (`prompt_tokens_details`) too."""
    return {
        name: summed([u[name] for u in usages]) if isinstance(value, dict) else sum(u[name] for u in usages)
        for name, value in usages[0].items()
    }


def merged(answers: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """One completions answer from each prompt's: the first's id and creation time, every choice
    renumbered (prompt k's choice c as k * n + c), the usage summed, every job named."""
    merged_answer = dict(answers[0])
    merged_answer["choices"] = [
        {**choice, "index": k * n + choice["index"]}
        for k, answer in enumerate(answers)
        for choice in answer["choices"]
    ]
    merged_answer["usage"] = summed([a["usage"] for a in answers])
    validation = [
        {**check, "index": k * n + check["index"]}
        for k, answer in enumerate(answers)
        for check in answer["expert_system"]["validation"]
    ]
    merged_answer["expert_system"] = {
        **answers[0]["expert_system"],
        "job_ids": [a["expert_system"]["job_id"] for a in answers],
        "experts": sorted({e for a in answers for e in a["expert_system"]["experts"]}),
        "validation_skipped": any(a["expert_system"]["validation_skipped"] for a in answers),
        "validation": validation,
    }
    return merged_answer
