"""A job's turn policy: what makes a turn of a session differ from a plain job, in one object the
saga (`pipeline.py`) asks at each step, so that the saga itself reads plan → place → generate →
finalize for both.

A plain job (`PlainTurn`) is planned by the router, placed anywhere, generates from the plan's
model input, and settles nothing. A session's turn (`SessionTurn`, docs/api.md#sessions) keeps the
experts and sampling its session's first turn chose, asks to be placed on the session's engine,
sends the engine the session's token history with the turn's new messages, takes the engine's
session limit as a refusal, and settles in the session's record what the engine confirmed.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

import grpc

from libs.errors import is_client_error
from libs.gen.expert.v1 import common_pb2, engine_pb2, preparation_pb2, session_state_pb2
from libs.response_format import from_request
from libs.tools.request import copy_tools
from services.reception.dispatch.choices import Choices
from services.reception.dispatch.errors import JobFailed
from services.reception.jobs import JobRecord
from services.reception.sessions import SessionStore, copy_sampling


class TurnPolicy(Protocol):
    # Whether a new run after a lost engine may go on from the output its caller already has
    # (GenerateRequest.resume_token_ids), rather than start over from the prompt.
    resumable: bool

    async def plan(
        self, route: Callable[[], Awaitable[common_pb2.ExpertPlan]], request: common_pb2.InferenceRequest
    ) -> common_pb2.ExpertPlan:
        """The job's plan: the router's (`route()`), or one the turn already has."""

    def prompt_bytes(self, plan: common_pb2.ExpertPlan) -> int:
        """The size of the prompt the engine computes, in bytes (which bound its tokens), for
        placement's KV budget."""

    def place(self, request: preparation_pb2.PrepareRequest) -> None:
        """Add the turn's placement hint to its Prepare."""

    def engine_input(self, request: engine_pb2.GenerateRequest, plan: common_pb2.ExpertPlan) -> None:
        """Set what the engine answers in its Generate."""

    def refuses(self, code: grpc.StatusCode) -> bool:
        """Whether an engine's error refuses the job (it fails) rather than losing it (the job is
        placed again on another engine)."""

    def confirm(self, final: engine_pb2.GenerateResponse, choices: Choices) -> None:
        """The engine's last message (every choice finished): what it confirmed of the turn."""

    async def settle(
        self, result: common_pb2.InferenceResult, plan: common_pb2.ExpertPlan, placement: common_pb2.Placement
    ) -> None:
        """The turn's end, before its result is announced."""


class PlainTurn:
    """A job on its own: the router plans it, any engine takes it, nothing settles after it."""

    resumable = True

    async def plan(
        self, route: Callable[[], Awaitable[common_pb2.ExpertPlan]], request: common_pb2.InferenceRequest
    ) -> common_pb2.ExpertPlan:
        return await route()

    def prompt_bytes(self, plan: common_pb2.ExpertPlan) -> int:
        return plan.prompt_bytes  # the router's measure of the rendered input

    def place(self, request: preparation_pb2.PrepareRequest) -> None:
        pass

    def engine_input(self, request: engine_pb2.GenerateRequest, plan: common_pb2.ExpertPlan) -> None:
        request.input.CopyFrom(plan.model_input)

    def refuses(self, code: grpc.StatusCode) -> bool:
        return is_client_error(code)

    def confirm(self, final: engine_pb2.GenerateResponse, choices: Choices) -> None:
        pass

    async def settle(
        self, result: common_pb2.InferenceResult, plan: common_pb2.ExpertPlan, placement: common_pb2.Placement
    ) -> None:
        pass


class SessionTurn:
    """A turn of a session: `record` is the session's record as the turn began."""

    # The engine keeps a turn's KV for the next one from the session's own history: a lost turn
    # starts over from it rather than carry a prefix the session's record does not know.
    resumable = False

    def __init__(self, store: SessionStore, record: session_state_pb2.SessionRecord, job_id: str) -> None:
        self.store = store
        self.record = record
        self.job_id = job_id
        # What the engine confirmed of the turn: the tokens it added before the reply, and the
        # reply's tokens (None: the engine never finished the turn).
        self.tokens: tuple[list[int], list[int]] | None = None
        self.usage = common_pb2.GenerationUsage()

    async def plan(
        self, route: Callable[[], Awaitable[common_pb2.ExpertPlan]], request: common_pb2.InferenceRequest
    ) -> common_pb2.ExpertPlan:
        # A later turn: the experts stay those the first turn chose (the router is not asked).
        return turn_plan(self.record, request) if self.record.planned else await route()

    def prompt_bytes(self, plan: common_pb2.ExpertPlan) -> int:
        # The engine computes at most the history, the turn's messages and the tools it lists
        # (bytes bound tokens).
        turn = self._engine_turn(plan)
        turn_bytes = sum(len(m.content.encode()) for m in turn.messages)
        turn_bytes += sum(len(t.SerializeToString()) + 256 for t in turn.tools)
        return len(self.record.token_ids) + turn_bytes + 64 * (1 + len(self.record.turn_input))

    def place(self, request: preparation_pb2.PrepareRequest) -> None:
        request.session = True
        request.session_engine = self.record.engine_id

    def engine_input(self, request: engine_pb2.GenerateRequest, plan: common_pb2.ExpertPlan) -> None:
        request.session.CopyFrom(self._engine_turn(plan))

    def refuses(self, code: grpc.StatusCode) -> bool:
        # A turn the engine has no room for (its session limit) is refused, not retried elsewhere.
        return is_client_error(code) or code == grpc.StatusCode.RESOURCE_EXHAUSTED

    def confirm(self, final: engine_pb2.GenerateResponse, choices: Choices) -> None:
        self.tokens = (list(final.session_input_token_ids), choices.token_ids(0))
        self.usage.CopyFrom(final.usage)

    async def settle(
        self, result: common_pb2.InferenceResult, plan: common_pb2.ExpertPlan, placement: common_pb2.Placement
    ) -> None:
        """What the engine confirmed joins the session's history; a turn the engine never
        finished gives its input back, to be answered next. Either frees the session for its next
        turn."""
        session_id = self.record.session_id
        if self.tokens is None:
            await self.store.abandon_turn(session_id, self.job_id)
            return
        input_ids, output_ids = self.tokens
        await self.store.end_turn(
            session_id,
            self.job_id,
            plan=plan,
            placement=placement,
            input_ids=input_ids,
            output_ids=output_ids,
            reply=result.text,
            finish_reason=result.finish_reason,
            usage=self.usage,
            tool_calls=list(result.choices[0].tool_calls) if result.choices else [],
            tools_shown=self._tools_to_show(plan),
        )

    def _engine_turn(self, plan: common_pb2.ExpertPlan) -> engine_pb2.SessionTurn:
        """The SessionTurn the engine answers: the history, the turn's messages (the whole
        conversation for a first turn) and the tools it lists anew."""
        record, limits = self.record, self.store.limits
        history = list(record.token_ids)
        messages = [*([] if history else record.messages), *record.turn_input]
        return engine_pb2.SessionTurn(
            session_id=record.session_id,
            history=history,
            messages=messages,
            max_tokens=limits.max_tokens,
            idle_seconds=limits.idle_seconds,
            tools=self._tools_to_show(plan) or [],
        )

    def _tools_to_show(self, plan: common_pb2.ExpertPlan) -> list[common_pb2.Tool] | None:
        """The turn's tools when the model has not seen them yet (the first turn that gives them,
        or one that changes them); None when what it saw last still holds. A turn going on with a
        cut reply lists nothing: it adds no message the listing could precede."""
        tools = list(plan.generation_params.tools)
        if not self.record.turn_input or not tools or tools == list(self.record.tools_shown):
            return None
        return tools


class Turns:
    """The policy of each job the dispatcher runs; `sessions` holds the session records (None: no
    session turns are run)."""

    def __init__(self, sessions: SessionStore | None = None) -> None:
        self.sessions = sessions

    async def begin(self, record: JobRecord) -> TurnPolicy:
        """The job's policy. A session's turn reads its session's record now (JobFailed NOT_FOUND
        when the session ended before its turn ran)."""
        if not record.session_id:
            return PlainTurn()
        session = await self.sessions.running_turn(record.session_id, record.job_id)
        if session is None:
            raise JobFailed(
                f"session {record.session_id} ended before its turn ran", grpc.StatusCode.NOT_FOUND
            )
        return SessionTurn(self.sessions, session, record.job_id)


def turn_plan(
    record: session_state_pb2.SessionRecord, request: common_pb2.InferenceRequest
) -> common_pb2.ExpertPlan:
    """A later turn's plan: the experts and sampling the first turn fixed (the KV the engine keeps
    is valid under these experts only), with this turn's explicit sampling."""
    plan = common_pb2.ExpertPlan()
    plan.CopyFrom(record.plan)
    params = plan.generation_params
    copy_sampling(request, "max_tokens", params, "max_tokens")
    params.ClearField("response_format")
    output_format = from_request(request)
    if output_format is not None:
        params.response_format.CopyFrom(output_format)
    copy_tools(request, params)
    plan.ClearField("model_input")
    experts = ", ".join(f"{e.name}@{e.version}" for e in plan.experts) or "none (the base model)"
    plan.reasoning_trace = (
        f"session turn {record.turns + 1}: the experts its first turn chose stay ({experts}); "
        "the engine continues the conversation's kept KV"
    )
    plan.router_latency_ms = 0.0
    return plan
