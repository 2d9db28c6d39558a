"""The Expert System's own REST API (docs/api.md#the-rest-api): `/v1/infer` and `/v1/jobs` over the
admission core's calls (`infer`, `stream`, `submit`, `get_job`, `cancel_job`), with the proto
messages (InferStream's, for a stream) as JSON under their proto field names; enums are their short
lower-case names (`completed`, `stop`), timestamps RFC 3339 strings and 64-bit integers numbers."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from libs.gen.expert.v1 import common_pb2
from services.reception.admission.beams import early_stopping_word
from services.reception.admission.core import Admission, Submitted
from services.reception.http.calls import infer
from services.reception.http.errors import HttpError, ToHttpError, error_response
from services.reception.http.response_format import parse_response_format
from services.reception.http.rest_schema import InferBody, JobBody
from services.reception.http.text_guard import TEXT_ONLY
from services.reception.job_events import JobEvent
from services.reception.server import stream_response

_INT64 = {
    FieldDescriptor.TYPE_INT64,
    FieldDescriptor.TYPE_UINT64,
    FieldDescriptor.TYPE_SINT64,
    FieldDescriptor.TYPE_FIXED64,
    FieldDescriptor.TYPE_SFIXED64,
}
_TIMESTAMP = "google.protobuf.Timestamp"


def to_request(body: JobBody) -> common_pb2.InferenceRequest:
    """The InferenceRequest a REST body spells out field for field (its unset fields stay unset),
    and the format its `response_format` asks for in OpenAI's shape."""
    for i, message in enumerate(body.messages):
        if message.content is None and not (message.role == "assistant" and message.tool_calls):
            param = f"messages[{i}].content"
            raise HttpError(400, f"{param}: Field required", param, "invalid_type")
    fields = _proto_shapes(body.model_dump(exclude_none=True, exclude={"stream", "response_format"}))
    if "early_stopping" in fields:
        fields["early_stopping"] = early_stopping_word(fields["early_stopping"])
    try:
        request = json_format.ParseDict(fields, common_pb2.InferenceRequest())
    except json_format.ParseError as exc:  # e.g. a float beyond float32's range
        found = re.search(r"at InferenceRequest\.([\w\[\]]+(?:\.[\w\[\]]+)*)", str(exc))
        param = found.group(1) if found else None
        raise HttpError(400, f"{param or 'body'}: {exc}", param, "invalid_type") from None
    if body.response_format is not None:
        response_format = parse_response_format(body.response_format, openai=False)
        if response_format is not None:
            request.response_format.CopyFrom(response_format)
    return request


def _proto_shapes(fields: dict[str, Any]) -> dict[str, Any]:
    """The body's tool fields as the proto's JSON spells them: schemas and arguments as JSON text,
    a tool_choice mode as its enum value."""
    for tool in fields.get("tools", []):
        tool["parameters"] = _json_text(tool.get("parameters", ""))
    for message in fields.get("messages", []):
        for call in message.get("tool_calls", []):
            call["arguments"] = _json_text(call.get("arguments", ""))
    choice = fields.get("tool_choice")
    if isinstance(choice, str):
        choice = {"mode": choice}
    if isinstance(choice, dict) and "mode" in choice:
        choice["mode"] = "TOOL_CHOICE_MODE_" + choice["mode"].upper()
    if choice is not None:
        fields["tool_choice"] = choice
    return fields


def _json_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def to_json(message: Message) -> dict[str, Any]:
    """A proto message as the REST API's JSON: every field under its proto name (those without
    presence always, those with it when set), enums short and lower-case, 64-bit integers as
    numbers."""
    data = json_format.MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    _tidy(data, message.DESCRIPTOR)
    return data


def _tidy(data: dict[str, Any], descriptor: Descriptor) -> None:
    for field in descriptor.fields:
        if field.name not in data:
            continue
        repeated = field.is_repeated
        values = data[field.name] if repeated else [data[field.name]]
        if field.message_type is not None and field.message_type.full_name != _TIMESTAMP:
            for value in values:
                _tidy(value, field.message_type)
            continue
        if field.enum_type is not None:
            prefix = re.sub(r"(?<!^)(?=[A-Z])", "_", field.enum_type.name).upper() + "_"
            values = [v.removeprefix(prefix).lower() if isinstance(v, str) else v for v in values]
        elif field.type in _INT64:
            values = [int(v) for v in values]
        else:
            continue
        data[field.name] = values if repeated else values[0]


def add_rest_routes(app: FastAPI, admission: Admission, as_http_error: ToHttpError) -> None:
    @app.post("/v1/infer", dependencies=[TEXT_ONLY])
    async def infer(request: Request, body: InferBody):
        return await _infer(admission, request, body, as_http_error)

    @app.post("/v1/jobs", status_code=202, dependencies=[TEXT_ONLY])
    async def submit(body: JobBody):
        inference = to_request(body)
        try:
            submission = await admission.submit(inference)
        except Exception as exc:
            return error_response(as_http_error(exc, body))
        return JSONResponse(
            to_json(submission),
            status_code=202,
            headers={"Location": f"/v1/jobs/{submission.job_id}"},
        )

    @app.get("/v1/jobs/{job_id}")
    async def get_job(job_id: str):
        try:
            return to_json(await admission.get_job(job_id))
        except Exception as exc:
            return error_response(as_http_error(exc, None))

    @app.delete("/v1/jobs/{job_id}")
    async def cancel_job(job_id: str):
        try:
            return to_json(await admission.cancel_job(job_id))
        except Exception as exc:
            return error_response(as_http_error(exc, None))


async def _infer(admission: Admission, request: Request, body: InferBody, as_http_error: ToHttpError):
    inference = to_request(body)
    if body.stream:
        return await _stream(admission, inference, body, as_http_error)
    result = await infer(admission, request, inference, body, as_http_error)
    return result if isinstance(result, JSONResponse) else to_json(result)


async def _stream(
    admission: Admission, inference: common_pb2.InferenceRequest, body: InferBody, as_http_error: ToHttpError
) -> StreamingResponse | JSONResponse:
    events = admission.stream(inference)
    try:
        first = await anext(events)  # admission: its refusal is the HTTP answer
    except Exception as exc:
        await events.aclose()
        return error_response(as_http_error(exc, body))
    return StreamingResponse(
        _events(first, events, body, as_http_error),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache"},
    )


def _sse(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


def _message(event: Submitted | JobEvent) -> str:
    """An event as InferStream's message in JSON: `event: <kind>` and `data: {"<kind>": …}`."""
    message = stream_response(event)
    return _sse(message.WhichOneof("event"), to_json(message))


async def _events(
    first: Submitted, events: AsyncIterator[JobEvent], body: InferBody, as_http_error: ToHttpError
) -> AsyncIterator[str]:
    """InferStream's messages as server-sent events, ending after the result. A refusal after the
    start is one `error` event. Closed early (the client went away), `events` is closed, which
    cancels the job."""
    async with contextlib.aclosing(events):
        yield _message(first)
        try:
            async for event in events:
                yield _message(event)
        except Exception as exc:  # a refusal at the end (e.g. an unknown forced expert)
            yield _sse("error", as_http_error(exc, body).body())
