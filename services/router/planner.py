"""Seed 000 stage 2 for one request: features, the expert choice (the base-model fallback until the
expert index exists), tuned parameters, the final model input, and a reasoning trace."""

from __future__ import annotations

import time

from libs.errors import invalid_argument
from libs.gen.expert.v1 import common_pb2
from services.router.features import extract_features
from services.router.tuning import tune_parameters

DEFAULT_BODY_TEMPLATE = "{prompt}\n\n{body}"
# Tokens a chat template adds around each message, for the KV budget's upper bound.
TEMPLATE_OVERHEAD_BYTES = 64


def render_template(template: str, prompt: str, body: str) -> str:
    """Substitute {prompt} and {body}; every other brace is literal (templates often hold JSON)."""
    return template.replace("{prompt}", prompt).replace("{body}", body)


def model_input(request: common_pb2.InferenceRequest) -> tuple[common_pb2.ModelInput, str]:
    """The engine's input and its text: the templated prompt, as is for a raw completion, otherwise
    as the last user turn of the conversation (after any system message) for the chat template."""
    body = request.body if request.HasField("body") else ""
    if request.HasField("template"):
        text = render_template(request.template, request.prompt, body)
    elif body:
        text = render_template(DEFAULT_BODY_TEMPLATE, request.prompt, body)
    else:
        text = request.prompt
    if request.raw:
        return common_pb2.ModelInput(text=text), text
    messages = list(request.messages)
    if text:
        messages.append(common_pb2.ChatMessage(role="user", content=text))
    return common_pb2.ModelInput(conversation=common_pb2.Conversation(messages=messages)), text


def input_bytes(model_input: common_pb2.ModelInput) -> int:
    """An upper bound of the input's token count: its UTF-8 bytes (a byte-level BPE never needs more)
    plus what a chat template adds per message."""
    if model_input.HasField("text"):
        return len(model_input.text.encode())
    messages = model_input.conversation.messages
    return sum(len(m.content.encode()) + TEMPLATE_OVERHEAD_BYTES for m in messages) + TEMPLATE_OVERHEAD_BYTES


class Planner:
    """Builds ExpertPlans. Until the expert index exists every plan is the base-model fallback."""

    def plan(
        self, request: common_pb2.InferenceRequest, max_model_len: int | None = None
    ) -> common_pb2.ExpertPlan:
        started = time.perf_counter()
        if request.force_experts:
            name = request.force_experts[0]
            raise invalid_argument(
                "request.force_experts[0]", f"unknown expert {name!r} (no experts are registered)"
            )
        text_for_features = request.prompt or (request.messages[-1].content if request.messages else "")
        features = extract_features(text_for_features, request.body if request.HasField("body") else None)
        params, tuning_trace = tune_parameters(features, request, max_model_len)
        model_in, text = model_input(request)
        trace = [
            f"features: language {features.language}, has_json {features.has_json}, "
            f"has_code {features.has_code}, task {features.task_type}",
            "experts: none registered; the base model answers (fallback)",
            *tuning_trace,
            "input: "
            + ("raw completion" if request.raw else "chat template, as the last user turn")
            + (", template rendered" if request.HasField("template") else "")
            + (", body appended" if request.HasField("body") and not request.HasField("template") else ""),
        ]
        return common_pb2.ExpertPlan(
            generation_params=params,
            model_input=model_in,
            prompt_modified=text,
            reasoning_trace="\n".join(trace),
            features=common_pb2.Features(
                language=features.language,
                has_json=features.has_json,
                has_code=features.has_code,
                task_type=features.task_type,
            ),
            fallback=True,
            router_latency_ms=(time.perf_counter() - started) * 1000,
            prompt_bytes=input_bytes(model_in),
        )
