"""OpenAI's fine-tuning API (docs/api.md#fine-tuning-api) over the training jobs: the same
TrainingAdmission, store and trainer as /v1/training/jobs, read and answered in OpenAI's shapes
(fine_tuning_request.py, fine_tuning_objects.py). Creating and cancelling need a train (or admin)
key (http/auth.py's ROUTE_ACCESS); reading one's own jobs needs any key. Every refusal is OpenAI's
error body, naming the field as OpenAI's client sent it."""

from __future__ import annotations

from typing import Any

from fastapi import Body, FastAPI, Request

from libs.errors import ServiceError, invalid_argument
from services.reception.http.errors import ToHttpError
from services.reception.http.fine_tuning_objects import checkpoint_object, event_object, job_object
from services.reception.http.fine_tuning_request import SEED_TO_OPENAI, openai_names, to_job_spec
from services.reception.http.json_answers import json_answer
from services.reception.http.training import caller_owner
from services.reception.training.admission import MAX_EVENTS, TrainingAdmission

PREFIX = "/v1/fine_tuning/jobs"
ANY_BODY = Body(None)  # any JSON: fine_tuning_request names each field it refuses
MAX_CHECKPOINTS_PAGE = 100


def _page(objects: list[dict[str, Any]], limit: int) -> dict[str, Any]:
    return {"object": "list", "data": objects[:limit], "has_more": len(objects) > limit}


def _in_openai_names(error: Exception, names: dict[str, str] = SEED_TO_OPENAI) -> BaseException:
    """A refusal of the seed spec's fields, naming them as the OpenAI request did (`names`)."""
    if not isinstance(error, ServiceError) or not error.violations:
        return error
    renamed = [(names.get(f, f), reason) for f, reason in error.violations]
    message = "; ".join(f"{f}: {reason}" for f, reason in renamed)
    return ServiceError(error.code, message, renamed)


class FineTuningRoutes:
    def __init__(self, admission: TrainingAdmission, as_http_error: ToHttpError) -> None:
        self.admission = admission
        self.as_http_error = as_http_error

    async def _answer(self, call, names: dict[str, str] = SEED_TO_OPENAI):
        return await json_answer(call, self.as_http_error, restate=lambda e: _in_openai_names(e, names))

    async def create(self, request: Request, body: Any = ANY_BODY):
        async def call():
            return job_object(await self.admission.create(caller_owner(request), to_job_spec(body)))

        return await self._answer(call, openai_names(body))

    async def list_jobs(self, request: Request, limit: int = 20, after: str = ""):
        async def call():
            if limit < 1:
                raise invalid_argument("limit", f"must be in [1, 100], got {limit}")
            jobs, more = await self.admission.list(caller_owner(request), limit, after)
            return {"object": "list", "data": [job_object(j) for j in jobs], "has_more": more}

        return await self._answer(call)

    async def get(self, request: Request, job_id: str):
        async def call():
            return job_object(await self.admission.get(caller_owner(request), job_id))

        return await self._answer(call)

    async def cancel(self, request: Request, job_id: str):
        async def call():
            return job_object(await self.admission.cancel(caller_owner(request), job_id))

        return await self._answer(call)

    async def events(self, request: Request, job_id: str, after: str = "", limit: int = 20):
        async def call():
            if not 1 <= limit < MAX_EVENTS:
                raise invalid_argument("limit", f"must be in [1, {MAX_EVENTS - 1}], got {limit}")
            # one more than asked for tells whether there is a next page
            events = await self.admission.events(
                caller_owner(request), job_id, after, limit + 1, newest_first=True
            )
            return _page([event_object(e) for e in events], limit)

        return await self._answer(call)

    async def checkpoints(self, request: Request, job_id: str, after: str = "", limit: int = 10):
        async def call():
            if not 1 <= limit <= MAX_CHECKPOINTS_PAGE:
                raise invalid_argument("limit", f"must be in [1, {MAX_CHECKPOINTS_PAGE}], got {limit}")
            newest_first = list(reversed(await self.admission.checkpoints(caller_owner(request), job_id)))
            ids = [c["id"] for c in newest_first]
            if after and after not in ids:
                raise invalid_argument("after", f"training job {job_id} has no checkpoint {after[:64]!r}")
            start = ids.index(after) + 1 if after else 0
            return _page([checkpoint_object(job_id, c) for c in newest_first[start:]], limit)

        return await self._answer(call)


def add_fine_tuning_routes(app: FastAPI, admission: TrainingAdmission, as_http_error: ToHttpError) -> None:
    routes = FineTuningRoutes(admission, as_http_error)
    app.add_api_route(PREFIX, routes.create, methods=["POST"])
    app.add_api_route(PREFIX, routes.list_jobs, methods=["GET"])
    app.add_api_route(PREFIX + "/{job_id}", routes.get, methods=["GET"])
    app.add_api_route(PREFIX + "/{job_id}/cancel", routes.cancel, methods=["POST"])
    app.add_api_route(PREFIX + "/{job_id}/events", routes.events, methods=["GET"])
    app.add_api_route(PREFIX + "/{job_id}/checkpoints", routes.checkpoints, methods=["GET"])
