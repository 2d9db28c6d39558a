"""The FastAPI app: the probes, `/v1/models`, the REST API's `/v1/infer` and `/v1/jobs` (rest.py),
OpenAI's chat and completions endpoints (openai.py) and its Responses API (responses.py), all over
the admission core (admission/core.py: admission, validation, the job record, the queue and the
job's events), and OpenAI's Files API for training data (files.py); errors in OpenAI's shape; the
API's OpenAPI document at /openapi.json (openapi.py)."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from libs.auth.policy import Authenticator
from libs.errors import ServiceError
from services.reception.admission.core import Admission
from services.reception.admission.sessions import SessionAdmission
from services.reception.capacity import Capacity
from services.reception.http.auth import authentication
from services.reception.http.body_guard import DEFAULT_MAX_BODY_BYTES, BodyGuard
from services.reception.http.errors import HttpError, as_http_error, error_response, validation_error
from services.reception.http.files import FILES_PATH, FileUploads, add_files_routes
from services.reception.http.fine_tuning import add_fine_tuning_routes
from services.reception.http.models import ServedModels
from services.reception.http.openai import add_openai_routes
from services.reception.http.openapi import OPENAPI_PATH, serve_openapi
from services.reception.http.rejections import count_refusal
from services.reception.http.response_store import ResponseStore
from services.reception.http.responses import add_responses_routes
from services.reception.http.rest import add_rest_routes
from services.reception.http.training import add_training_routes
from services.reception.metrics import ReceptionMetrics
from services.reception.training.admission import TrainingAdmission

PROBE_METHODS = ["GET", "HEAD"]


def create_app(
    admission: Admission,
    capacity: Capacity,
    models: ServedModels,
    error_mapper: Callable[[BaseException], ServiceError | None] | None = None,
    auth: Authenticator | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    serving: Callable[[], bool] = lambda: True,
    metrics: ReceptionMetrics | None = None,
    responses: ResponseStore | None = None,
    sessions: SessionAdmission | None = None,
    training: TrainingAdmission | None = None,
    files: FileUploads | None = None,
) -> FastAPI:
    """The HTTP front over `admission`. `error_mapper` turns an exception that is not a
    ServiceError (e.g. Redis down) into one; `auth` checks every /v1 call's API key (None: none);
    a body over `max_body_bytes` is refused (413) before anything else reads it; `serving` is what
    the gRPC health service reports (False while Redis is unreachable or reception stops);
    `metrics` counts the refusals and the ignored fields (None: not counted);
    `responses` keeps the Responses API's stored responses (None: none are stored), each a turn
    of a session of `sessions` (None: as a plain job); `training` admits training jobs (None: no
    training routes); `files` holds the training files of the Files API (None: no /v1/files)."""
    app = FastAPI(
        title="Expert System",
        docs_url=None,
        redoc_url=None,
        # The API's description at /openapi.json (openapi.py), without a key, as vLLM serves it.
        openapi_url=OPENAPI_PATH,
        # The API key of every /v1 call (the probes need none); nothing is checked without `auth`.
        dependencies=[Depends(authentication(auth, error_mapper))],
    )
    # Outside every route and dependency: no body is read past its bound, keyed or not.
    app.add_middleware(
        BodyGuard,
        max_bytes=max_body_bytes,
        on_refused=functools.partial(count_refusal, metrics),
        uploads={FILES_PATH: files.upload_route()} if files is not None else None,
    )
    _add_error_handlers(app, metrics)
    to_http_error = functools.partial(as_http_error, error_mapper=error_mapper)
    add_rest_routes(app, admission, to_http_error)
    _add_probes(app, capacity, serving)
    _add_models(app, models)
    add_openai_routes(app, admission, to_http_error, metrics)
    add_responses_routes(app, admission, responses, to_http_error, sessions)
    if training is not None:
        add_training_routes(app, training, to_http_error)
        add_fine_tuning_routes(app, training, to_http_error)
    if files is not None:
        add_files_routes(app, files, to_http_error)
    serve_openapi(app)
    return app


def _add_error_handlers(app: FastAPI, metrics: ReceptionMetrics | None) -> None:
    """Every refusal in OpenAI's error body, counted (rejections.py): a bad body, an HttpError (a
    refused field or key); then no such path or method."""

    def refuse(error: HttpError) -> JSONResponse:
        count_refusal(metrics, error)
        return error_response(error)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        return refuse(validation_error(exc))

    @app.exception_handler(HttpError)
    async def http_error(request: Request, exc: HttpError) -> JSONResponse:
        return refuse(exc)

    @app.exception_handler(HTTPException)
    async def unparsable_body(request: Request, exc: HTTPException) -> JSONResponse:
        # FastAPI's answer to a body its JSON parser raised on other than a syntax error: bytes
        # that are not UTF-8, an integer of more than 4,300 digits.
        if exc.status_code != 400:
            return error_response(HttpError(exc.status_code, str(exc.detail)))
        reason = exc.__cause__ if exc.__cause__ is not None else exc.detail
        return refuse(HttpError(400, f"the body is not valid JSON: {reason}", None, "invalid_json"))

    @app.exception_handler(404)
    async def no_route(request: Request, exc: Exception) -> JSONResponse:
        return error_response(HttpError(404, f"no such endpoint: {request.method} {request.url.path}"))

    @app.exception_handler(405)
    async def no_method(request: Request, exc: Exception) -> JSONResponse:
        return error_response(HttpError(405, f"method {request.method} is not allowed on {request.url.path}"))


def _add_probes(app: FastAPI, capacity: Capacity, serving: Callable[[], bool]) -> None:
    """/livez (the process answers), /readyz (serving, as gRPC health says, and an engine is
    registered), /healthz (an engine is registered) and /health (vLLM's: /readyz's answer as a bare
    status, no body). Each answers HEAD as GET (load balancers probe with either)."""

    @app.api_route("/livez", methods=PROBE_METHODS)
    async def livez() -> dict:
        return {"status": "ok"}

    async def ready() -> tuple[bool, bool, int]:
        engines = (await capacity.get()).engines
        up = serving()  # read after the await: the state at the answer, not before it
        return up and engines > 0, up, engines

    @app.api_route("/readyz", methods=PROBE_METHODS)
    async def readyz() -> JSONResponse:
        is_ready, up, engines = await ready()
        return JSONResponse(
            {"status": "ready" if is_ready else "not ready", "serving": up, "engines": engines},
            status_code=200 if is_ready else 503,
        )

    @app.api_route("/health", methods=PROBE_METHODS)
    async def health() -> Response:
        is_ready, _, _ = await ready()
        return Response(status_code=200 if is_ready else 503)

    @app.api_route("/healthz", methods=PROBE_METHODS)
    async def healthz() -> dict:
        engines = (await capacity.get()).engines
        return {"status": "ok" if engines > 0 else "degraded", "engines": engines}


def _add_models(app: FastAPI, models: ServedModels) -> None:
    """GET /v1/models and GET /v1/models/{id} (OpenAI's `models.retrieve`, `<base>:<expert>` ids
    too): a model no engine serves is 404 with code `model_not_found`, as OpenAI answers."""
    started = int(time.time())

    def entry(name: str) -> dict:
        return {"id": name, "object": "model", "created": started, "owned_by": "expert-system"}

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [entry(name) for name in await models.names()]}

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> dict:
        if model_id not in await models.names():
            raise HttpError(404, f"the model {model_id!r} does not exist", "model", "model_not_found")
        return entry(model_id)
