"""The training job routes on the HTTP front, over the same admission as the gRPC
TrainingService (docs/api.md#training-jobs): /v1/training/jobs and, per job, its checkpoint
request, checkpoints, resume and events. Changing a job needs a train (or admin) key: another key
gets 403 permission_denied. Every refusal is OpenAI's error body."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Body, FastAPI
from fastapi.responses import JSONResponse

from libs.auth.keys import ADMIN, TRAIN
from libs.auth.policy import current_caller
from libs.errors import invalid_argument, permission_denied
from services.reception.http.errors import error_response
from services.reception.training.admission import TrainingAdmission

PREFIX = "/v1/training/jobs"
_TRAINERS = (TRAIN, ADMIN, "internal")
ANY_OBJECT = Body(...)  # any JSON object: the admission names each field it refuses
OPTIONAL_OBJECT = Body(None)


def require_train_scope() -> None:
    """Refuses a caller whose key may not train (with auth off there is no caller: all may)."""
    caller = current_caller()
    if caller is not None and caller.scope not in _TRAINERS:
        raise permission_denied(f"API key {caller.key_id} has scope {caller.scope}; training needs train")


class TrainingRoutes:
    def __init__(self, admission: TrainingAdmission, as_http_error) -> None:
        self.admission = admission
        self.as_http_error = as_http_error

    async def _answer(self, call: Callable[[], Awaitable[Any]], status: int = 200, train: bool = False):
        try:
            if train:
                require_train_scope()
            return JSONResponse(await call(), status_code=status)
        except Exception as exc:
            return error_response(self.as_http_error(exc, None))

    async def create(self, body: dict[str, Any] = ANY_OBJECT):
        async def call():
            return (await self.admission.create(body)).to_dict()

        return await self._answer(call, 201, train=True)

    async def list_jobs(self, limit: int = 0, after: str = ""):
        async def call():
            jobs, more = await self.admission.list(limit, after)
            return {"object": "list", "data": [j.to_dict() for j in jobs], "has_more": more}

        return await self._answer(call)

    async def get(self, job_id: str):
        async def call():
            return (await self.admission.get(job_id)).to_dict()

        return await self._answer(call)

    async def cancel(self, job_id: str):
        async def call():
            return (await self.admission.cancel(job_id)).to_dict()

        return await self._answer(call, train=True)

    async def checkpoint(self, job_id: str):
        async def call():
            return {"checkpoint_id": await self.admission.checkpoint(job_id)}

        return await self._answer(call, 202, train=True)

    async def checkpoints(self, job_id: str):
        async def call():
            return {"object": "list", "data": await self.admission.checkpoints(job_id)}

        return await self._answer(call)

    async def resume(self, job_id: str, body: dict[str, Any] | None = OPTIONAL_OBJECT):
        async def call():
            checkpoint_id = (body or {}).get("checkpoint_id") or ""
            if not isinstance(checkpoint_id, str):
                raise invalid_argument("checkpoint_id", "must be a string")
            return (await self.admission.resume(job_id, checkpoint_id)).to_dict()

        return await self._answer(call, train=True)

    async def events(self, job_id: str, after: str = "", limit: int = 0):
        async def call():
            return {"object": "list", "data": await self.admission.events(job_id, after, limit)}

        return await self._answer(call)


def add_training_routes(app: FastAPI, admission: TrainingAdmission, as_http_error) -> None:
    routes = TrainingRoutes(admission, as_http_error)
    app.add_api_route(PREFIX, routes.create, methods=["POST"])
    app.add_api_route(PREFIX, routes.list_jobs, methods=["GET"])
    app.add_api_route(PREFIX + "/{job_id}", routes.get, methods=["GET"])
    app.add_api_route(PREFIX + "/{job_id}", routes.cancel, methods=["DELETE"])
    app.add_api_route(PREFIX + "/{job_id}/checkpoint", routes.checkpoint, methods=["POST"])
    app.add_api_route(PREFIX + "/{job_id}/checkpoints", routes.checkpoints, methods=["GET"])
    app.add_api_route(PREFIX + "/{job_id}/resume", routes.resume, methods=["POST"])
    app.add_api_route(PREFIX + "/{job_id}/events", routes.events, methods=["GET"])
