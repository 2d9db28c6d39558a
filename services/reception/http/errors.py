"""OpenAI's error body: a gRPC ServiceError or a refused body as `{"error": {message, type, param, code}}`
with the HTTP status that goes with it, the field named as the client sent it."""

from __future__ import annotations

import math
import re
from collections.abc import Callable

import grpc
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from libs.errors import ServiceError
from libs.logging import get_logger
from services.reception.admission.core import JobHandedBack
from services.reception.http.body_text import INVALID_TEXT
from services.reception.http.openai_schema import (
    FIELD_NAMES,
    ChatCompletionRequest,
    CompletionRequest,
)
from services.reception.http.responses_schema import FIELD_NAMES as RESPONSES_FIELD_NAMES
from services.reception.http.rest_schema import FIELD_NAMES as REST_FIELD_NAMES

log = get_logger(__name__)

# The HTTP status of a gRPC status; any other is 500.
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
}


# The `code` of an error whose site names none: every error body carries a code, never null.
DEFAULT_CODE = {
    400: "invalid_request",
    401: "invalid_api_key",
    403: "permission_denied",
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
    415: "unsupported_media_type",
    429: "rate_limit_exceeded",
    503: "service_unavailable",
}


class HttpError(Exception):
    """An OpenAI error to answer with; `headers` go with it (Retry-After on a 429). `code` defaults
    to the status's (DEFAULT_CODE), so no answer has a null code."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        job_id: str | None = None,
    ) -> None:
        super().__init__(message)
        self.job_id = job_id  # the job the error is about, when the caller could not know its id
        # Text the client sent (a field's name, a value) may hold lone surrogates, which no JSON
        # answer can carry: they are written as their escapes.
        self.message, self.param = printable(message), printable(param) if param is not None else None
        self.status, self.code = status, code or DEFAULT_CODE.get(status, "internal")
        self.headers = headers or {}
        self.type = {
            400: "invalid_request_error",
            401: "invalid_request_error",
            403: "invalid_request_error",
            404: "invalid_request_error",
            405: "invalid_request_error",
            413: "invalid_request_error",
            415: "invalid_request_error",
            429: "rate_limit_error",
            503: "service_unavailable_error",
        }.get(status, "server_error")

    def body(self) -> dict:
        """OpenAI's error body: the answer's JSON, and a stream's error event."""
        body: dict = {
            "error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        }
        if self.job_id is not None:  # where a response carries it (openai_response.extra)
            body["expert_system"] = {"job_id": self.job_id}
        return body


def printable(text: str) -> str:
    """`text` with each lone surrogate (not encodable as UTF-8) as its escape, e.g. `\\ud800`."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


# How a route turns an exception into its error body, given the request's body (None before it parsed).
ToHttpError = Callable[[BaseException, object], "HttpError"]


def not_supported(param: str, what: str) -> HttpError:
    return HttpError(400, f"{what} is not supported yet", param, "unsupported_parameter")


def param_of(field: str, body: object) -> str | None:
    """The name of a field a violation names as the client sent it ("request.temperature" ->
    "temperature"); `body` is the request's body (OpenAI's, or the REST API's with proto names)."""
    name = field.removeprefix("request.").removeprefix("request")
    if not name:
        return None
    head = re.match(r"[a-z_]+", name)
    rest = name[head.end() :] if head else ""
    base = head.group(0) if head else name
    if base == "user_id" and isinstance(body, (ChatCompletionRequest, CompletionRequest)):
        base = "user"  # OpenAI's name; the REST API keeps the proto's
    elif base == "prompt_token_ids" and isinstance(body, CompletionRequest):
        base = "prompt"  # OpenAI's token-id prompt
    elif base == "prompt" and isinstance(body, ChatCompletionRequest):
        base = "messages"  # a chat has no prompt: an empty one is an empty conversation
    elif base == "max_tokens" and isinstance(body, ChatCompletionRequest):
        base = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    elif base == "logprobs" and isinstance(body, ChatCompletionRequest):
        base = "top_logprobs" if body.top_logprobs is not None else "logprobs"
    elif base == "force_experts" and isinstance(body, (ChatCompletionRequest, CompletionRequest)):
        return _forced_param(rest, body)
    elif (
        base in ("tools", "tool_choice") and isinstance(body, ChatCompletionRequest) and body.legacy_functions
    ):
        # the deprecated form: functions[i].name, function_call.name
        return ("functions" if base == "tools" else "function_call") + rest.replace(".function", ".name")
    elif isinstance(body, ChatCompletionRequest):
        rest = _chat_nesting(base, rest)
    return base + rest


def _chat_nesting(base: str, rest: str) -> str:
    """OpenAI's nesting of a chat's functions, which the request's proto keeps flat:
    tools[i].function.name, tool_choice.function.name, messages[i].tool_calls[j].function.arguments."""
    if base in ("tools", "tool_choice"):
        rest = re.sub(r"^(\[\d+\])?\.(name|description|parameters|strict)$", r"\1.function.\2", rest)
        return re.sub(r"^\.function$", ".function.name", rest)
    if base == "messages":
        return re.sub(r"^(\[\d+\]\.tool_calls\[\d+\])\.(name|arguments)$", r"\1.function.\2", rest)
    return rest


def _forced_param(rest: str, body: ChatCompletionRequest | CompletionRequest) -> str:
    """`force_experts[i]` of the request as the client sent it: `model` for the expert `model` named
    (`<base>:<expert>`, forced first), else its place in the body's `force_experts`."""
    if body.model_expert is None:
        return "force_experts" + rest
    given = list(body.force_experts or [])
    index = re.fullmatch(r"\[(\d+)\]", rest)
    if index is None:  # the list as a whole
        return "force_experts" + rest if given else "model"
    forced = body.forced_experts()
    i = int(index.group(1))
    if i == 0 or i >= len(forced):
        return "model"
    return f"force_experts[{given.index(forced[i])}]"


def error_response(error: HttpError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def as_http_error(
    exc: BaseException,
    body: object,
    error_mapper: Callable[[BaseException], ServiceError | None] | None = None,
) -> HttpError:
    """The HTTP error for an exception a call raised: a ServiceError (or what `error_mapper` makes
    of another exception, e.g. Redis down -> UNAVAILABLE) as its status; anything else a logged 500."""
    if not isinstance(exc, ServiceError) and error_mapper is not None:
        exc = error_mapper(exc) or exc
    if isinstance(exc, ServiceError):
        return from_service_error(exc, body)
    log.exception("HTTP request failed", exc_info=exc)
    return HttpError(500, "internal error", code="internal")


def from_service_error(error: ServiceError, body: object) -> HttpError:
    status = HTTP_STATUS.get(error.code, 500)
    param = param_of(error.violations[0][0], body) if error.violations else None
    message = error.message
    if error.violations:  # name the fields as the client sent them
        message = "; ".join(f"{param_of(f, body) or 'request'}: {d}" for f, d in error.violations)
    code = error.code.name.lower()
    if param == "model":
        # A base model no engine serves, or `<base>:<expert>` with an expert not registered (or
        # trained for another base model): OpenAI's answer to a model it does not have.
        status, code = 404, "model_not_found"
    if error.code is grpc.StatusCode.UNAUTHENTICATED:
        code = "invalid_api_key"  # what OpenAI's clients expect for a missing, wrong or revoked key
    headers = {}
    if error.retry_after_s is not None:  # whole seconds, as HTTP wants them, never rounded down
        headers["Retry-After"] = str(max(1, math.ceil(error.retry_after_s)))
    job_id = error.job_id if isinstance(error, JobHandedBack) else None
    return HttpError(status, message, param, code, headers, job_id)


def validation_error(exc: RequestValidationError) -> HttpError:
    errors = exc.errors()
    if not errors:
        return HttpError(400, "invalid request")
    # Text that is no text is what the client got wrong, though a union lists its other members'
    # errors first (`stop`: "a valid string", when the list it sent holds a lone surrogate).
    first = next((e for e in errors if e.get("type") in _UNDECODABLE), errors[0])
    kind = first.get("type")
    if kind == "json_invalid":
        reason = first.get("ctx", {}).get("error", first.get("msg", ""))
        return HttpError(400, f"the body is not valid JSON: {reason}", None, "invalid_json")
    unknown = kind == "extra_forbidden"
    param = _param(list(first.get("loc", ()))[1:], unknown)  # after "body"
    if unknown:
        return HttpError(
            400, f"unrecognized request argument supplied: {param}", param or None, "unknown_parameter"
        )
    if kind in _UNDECODABLE:
        message = f"{param or 'body'}: {_UNDECODABLE[kind] or first.get('msg')}"
        return HttpError(400, message, param or None, "invalid_value")
    return HttpError(400, f"{param or 'body'}: {first.get('msg', 'invalid')}", param or None, "invalid_type")


# The validation errors of text that UTF-8 cannot carry, with the message to give (None: pydantic's).
_UNDECODABLE = {
    INVALID_TEXT: None,
    "string_unicode": "a field name is not valid Unicode text: it holds a lone surrogate",
}


_KNOWN_FIELDS = FIELD_NAMES | REST_FIELD_NAMES | RESPONSES_FIELD_NAMES


def _param(parts: list, unknown: bool) -> str:
    """The field a validation error's location names, as the client sent it (`messages[0].role`);
    pydantic's type tags (`function-after[…]`) left out, and an unknown field's own name kept."""
    param = ""
    for i, part in enumerate(parts):
        if isinstance(part, int):
            param += f"[{part}]"
        elif part in _KNOWN_FIELDS or (unknown and i == len(parts) - 1):
            param += f".{part}" if param else part
    return param
