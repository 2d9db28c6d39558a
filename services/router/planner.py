"""The reasoning stage for one request: features, the expert choice (selection over the expert
index, or the base-model fallback), tuned parameters, the final model input, and a reasoning
trace."""

from __future__ import annotations

import asyncio
import time

from libs.errors import invalid_argument
from libs.gen.expert.v1 import common_pb2
from libs.input_size import input_bytes
from libs.limits import MAX_EXPERTS
from libs.prompt_template import DEFAULT_BODY_TEMPLATE, render_template
from libs.response_format import from_request
from libs.tools.request import calls_enabled, copy_tools
from services.router.features import Features, extract_features, for_format
from services.router.index import ExpertIndex
from services.router.matching import PromptQuery
from services.router.selection import Candidate, Selection, select_experts
from services.router.tuning import DEFAULT_MAX_TOKENS_CEILING, tune_parameters


def model_input(request: common_pb2.InferenceRequest) -> tuple[common_pb2.ModelInput, str]:
    """The engine's input and its text: the templated prompt, as is for a raw completion, otherwise
    as the last user turn of the conversation (after any system message) for the chat template;
    token ids as they are (their text, for the trace and the logs, says how many there are)."""
    if request.prompt_token_ids:
        ids = common_pb2.TokenIds(ids=request.prompt_token_ids)
        return common_pb2.ModelInput(token_ids=ids), f"<{len(ids.ids)} token ids>"
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


def _format_trace(request: common_pb2.InferenceRequest, format_kind: str | None) -> list[str]:
    if format_kind is None:
        return []
    source = "json_schema, the shorthand" if request.HasField("json_schema") else "response_format"
    return [f"format: {format_kind} (the request's {source}), enforced by the engine as it samples"]


def copy_beam_search(
    request: common_pb2.InferenceRequest, params: common_pb2.GenerationParams, trace: list[str]
) -> None:
    """The request's best_of and beam-search settings. A beam search ranks by the model's own
    probabilities: the tuned sampling (which reception let through only where the user left it
    unset) goes back to neutral, temperature 0."""
    if request.HasField("best_of"):
        params.best_of = request.best_of
    if not request.use_beam_search:
        return
    params.use_beam_search = True
    if request.HasField("length_penalty"):
        params.length_penalty = request.length_penalty
    params.early_stopping = request.early_stopping if request.HasField("early_stopping") else ""
    params.temperature, params.top_p, params.top_k, params.min_p = 0.0, 1.0, 0, 0.0
    params.repetition_penalty, params.presence_penalty, params.frequency_penalty = 1.0, 0.0, 0.0
    trace.append("tuning: beam search ranks by the model's probabilities (temperature 0, no penalties)")


class Planner:
    """Builds ExpertPlans: the reasoning stage over the expert index (without an index, or with
    nothing registered, every plan is the base-model fallback)."""

    def __init__(
        self, index: ExpertIndex | None = None, max_tokens_ceiling: int = DEFAULT_MAX_TOKENS_CEILING
    ) -> None:
        self.index = index
        self.max_tokens_ceiling = max_tokens_ceiling  # the default max_tokens at most

    async def plan(
        self,
        request: common_pb2.InferenceRequest,
        max_model_len: int | None = None,
        model_defaults: common_pb2.SamplingDefaults | None = None,
        base_model_hash: str = "",
    ) -> tuple[common_pb2.ExpertPlan, Selection | None]:
        """The plan, and the selection it came from (None when no expert was considered).
        `max_model_len`, `model_defaults` and `base_model_hash` describe the request's model, as
        preparation reports it; only experts that fit `base_model_hash` are selected ("": any)."""
        started = time.perf_counter()
        output_format = from_request(request)
        format_kind = output_format.WhichOneof("format") if output_format is not None else None
        prompt_features, selection = await self._features_and_selection(request, base_model_hash, format_kind)
        features = for_format(prompt_features, format_kind)
        params, tuning_trace = tune_parameters(
            features, request, max_model_len, model_defaults, self.max_tokens_ceiling
        )
        if output_format is not None:
            params.response_format.CopyFrom(output_format)
        copy_tools(request, params)
        if calls_enabled(params) and not request.HasField("repetition_penalty"):
            # A call copies the tool's name and the user's values from the prompt: a penalty on
            # the prompt's tokens would work against exactly those.
            params.repetition_penalty = 1.0
            tuning_trace.append(
                "tuning: repetition_penalty 1.0 (tool calls copy names and values from the prompt)"
            )
        if request.HasField("speculative"):
            params.speculative = request.speculative
        copy_beam_search(request, params, tuning_trace)
        model_in, text = model_input(request)
        trace = _reasoning_trace(request, features, prompt_features, format_kind, selection, tuning_trace)
        chosen = selection.chosen if selection else []
        plan = common_pb2.ExpertPlan(
            experts=_planned_experts(chosen, set(request.force_experts)),
            composition_order=[c.expert.name for c in chosen],
            generation_params=params,
            model_input=model_in,
            prompt_modified=text,
            reasoning_trace="\n".join(trace),
            features=_features_proto(features),
            fallback=not chosen,
            prompt_bytes=input_bytes(model_in, request.tools),
        )
        plan.router_latency_ms = (time.perf_counter() - started) * 1000
        return plan, selection

    async def _features_and_selection(
        self, request: common_pb2.InferenceRequest, base_model_hash: str, format_kind: str | None
    ) -> tuple[Features, Selection | None]:
        """The prompt's own features (of the prompt, else the last message), and the selection."""
        text = request.prompt or (request.messages[-1].content if request.messages else "")
        body = request.body if request.HasField("body") else None
        if not self._can_select(request):
            prompt_features = extract_features(text, body)
            return prompt_features, self._select(
                request, for_format(prompt_features, format_kind), None, base_model_hash
            )
        # CPU work (the language model in numpy, the encoder in torch) and the index's Qdrant and Redis
        # reads: off the event loop, in one executor call, since splitting the CPU work only makes
        # its parts contend for the GIL.
        return await asyncio.get_running_loop().run_in_executor(
            None, self._analyse_and_select, request, text, body, base_model_hash, format_kind
        )

    def _can_select(self, request: common_pb2.InferenceRequest) -> bool:
        return self.index is not None and (bool(request.force_experts) or self.index.count() > 0)

    def _analyse_and_select(
        self,
        request: common_pb2.InferenceRequest,
        text: str,
        body: str | None,
        base_model_hash: str,
        format_kind: str | None,
    ) -> tuple[Features, Selection | None]:
        """The prompt's own features, and the selection for the request's (its format's task type)."""
        prompt_features = extract_features(text, body)
        query = PromptQuery.encode(self.index.encoder, text)
        selection = self._select(request, for_format(prompt_features, format_kind), query, base_model_hash)
        return prompt_features, selection

    def _select(
        self,
        request: common_pb2.InferenceRequest,
        features: Features,
        query: PromptQuery | None,
        base_model_hash: str,
    ) -> Selection | None:
        if query is None:
            if request.force_experts:
                name = request.force_experts[0]
                raise invalid_argument(
                    "request.force_experts[0]", f"unknown expert {name!r} (no experts are registered)"
                )
            return None
        return select_experts(
            features,
            query,
            self.index,
            max_experts=request.max_experts if request.HasField("max_experts") else MAX_EXPERTS,
            force=list(request.force_experts),
            exclude=list(request.exclude_experts),
            base_model_hash=base_model_hash,
        )


def _reasoning_trace(
    request: common_pb2.InferenceRequest,
    features: Features,
    prompt_features: Features,
    format_kind: str | None,
    selection: Selection | None,
    tuning_trace: list[str],
) -> list[str]:
    """The plan's reasoning, step by step: features, experts, parameters, format, input."""
    return [
        _features_trace(features, prompt_features, format_kind),
        *(selection.trace if selection else ["experts: none registered; the base model answers (fallback)"]),
        *tuning_trace,
        *_format_trace(request, format_kind),
        _input_trace(request),
    ]


def _features_trace(features: Features, prompt_features: Features, format_kind: str | None) -> str:
    task = f"task {features.task_type}"
    if format_kind is not None:
        task += f" (the request's {format_kind} format; the prompt reads as {prompt_features.task_type})"
    return (
        f"features: language {features.language}, has_json {features.has_json}, "
        f"has_code {features.has_code}, {task}"
    )


def _input_trace(request: common_pb2.InferenceRequest) -> str:
    return (
        "input: "
        + (
            "token ids, completed as is"
            if request.prompt_token_ids
            else "raw completion"
            if request.raw
            else "chat template, as the last user turn"
        )
        + (", template rendered" if request.HasField("template") else "")
        + (", body appended" if request.HasField("body") and not request.HasField("template") else "")
    )


def _planned_experts(chosen: list[Candidate], forced: set[str]) -> list[common_pb2.PlannedExpert]:
    return [
        common_pb2.PlannedExpert(
            name=c.expert.name,
            version=c.expert.version,
            adapter_type=c.expert.adapter_type,
            weight=1.0,
            score=c.score,
            vram_bytes=c.expert.weight_bytes,
            content_hash=c.expert.content_hash,
            forced=c.expert.name in forced,
        )
        for c in chosen
    ]


def _features_proto(features: Features) -> common_pb2.Features:
    return common_pb2.Features(
        language=features.language,
        has_json=features.has_json,
        has_code=features.has_code,
        task_type=features.task_type,
    )
