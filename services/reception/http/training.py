"""The training job routes on the HTTP front, over the same admission as the gRPC
TrainingService (docs/api.md#training-jobs): /v1/training/jobs and, per job, its checkpoint
request, checkpoints, resume and events. Changing a job needs a train (or admin) key (http/auth.py's
ROUTE_ACCESS): another key gets 403 permission_denied. Every refusal is OpenAI's error body."""

from __future__ import annotations

from typing import Any

from fastapi import Body, FastAPI, Request

from libs.auth.policy import current_caller
from libs.errors import invalid_argument
from libs.training.files import owner_of
from services.reception.http.errors import ToHttpError
from services.reception.http.json_answers import json_answer
from services.reception.training.admission import TrainingAdmission

PREFIX = "/v1/training/jobs"
ANY_OBJECT = Body(...)  # any JSON object: the admission names each field it refuses
OPTIONAL_OBJECT = Body(None)


def caller_owner(request: Request) -> str:
    """Whose jobs (and files) the call sees: the same owner as the Files API's."""
    return owner_of(current_caller(), request.client.host if request.client else "")


class TrainingRoutes:
    def __init__(self, admission: TrainingAdmission, as_http_error: ToHttpError) -> None:
        self.admission = admission
        self.as_http_error = as_http_error

    async def _answer(self, call, status: int = 200):
        return await json_answer(call, self.as_http_error, status)

    async def create(self, request: Request, body: dict[str, Any] = ANY_OBJECT):
        async def call():
            return (await self.admission.create(caller_owner(request), body)).to_dict()

        return await self._answer(call, 201)

    async def list_jobs(self, request: Request, limit: int = 0, after: str = ""):
        async def call():
            jobs, more = await self.admission.list(caller_owner(request), limit, after)
            return {"object": "list", "data": [j.to_dict() for j in jobs], "has_more": more}

        return await self._answer(call)

    async def get(self, request: Request, job_id: str):
        async def call():
            return (await self.admission.get(caller_owner(request), job_id)).to_dict()

        return await self._answer(call)

    async def cancel(self, request: Request, job_id: str):
        async def call():
            return (await self.admission.cancel(caller_owner(request), job_id)).to_dict()

        return await self._answer(call)

    async def checkpoint(self, request: Request, job_id: str):
        async def call():
            return {"checkpoint_id": await self.admission.checkpoint(caller_owner(request), job_id)}

        return await self._answer(call, 202)

    async def checkpoints(self, request: Request, job_id: str):
        async def call():
            return {"object": "list", "data": await self.admission.checkpoints(caller_owner(request), job_id)}

        return await self._answer(call)

    async def resume(self, request: Request, job_id: str, body: dict[str, Any] | None = OPTIONAL_OBJECT):
        async def call():
            checkpoint_id = (body or {}).get("checkpoint_id") or ""
            if not isinstance(checkpoint_id, str):
                raise invalid_argument("checkpoint_id", "must be a string")
            return (await self.admission.resume(caller_owner(request), job_id, checkpoint_id)).to_dict()

        return await self._answer(call)

    async def events(self, request: Request, job_id: str, after: str = "", limit: int = 0):
        async def call():
            events = await self.admission.events(caller_owner(request), job_id, after, limit)
            return {"object": "list", "data": events}

        return await self._answer(call)


def add_training_routes(app: FastAPI, admission: TrainingAdmission, as_http_error: ToHttpError) -> None:
    routes = TrainingRoutes(admission, as_http_error)
    app.add_api_route(PREFIX, routes.create, methods=["POST"])
    app.add_api_route(PREFIX, routes.list_jobs, methods=["GET"])
    app.add_api_route(PREFIX + "/{job_id}", routes.get, methods=["GET"])
    app.add_api_route(PREFIX + "/{job_id}", routes.cancel, methods=["DELETE"])
    app.add_api_route(PREFIX + "/{job_id}/checkpoint", routes.checkpoint, methods=["POST"])
    app.add_api_route(PREFIX + "/{job_id}/checkpoints", routes.checkpoints, methods=["GET"])
    app.add_api_route(PREFIX + "/{job_id}/resume", routes.resume, methods=["POST"])
    app.add_api_route(PREFIX + "/{job_id}/events", routes.events, methods=["GET"])
