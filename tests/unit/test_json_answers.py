"""json_answer, the one answer of the training and fine-tuning routes: the call's body with the
route's status, or OpenAI's error body for what it raised, after the route's renaming."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from libs.errors import ServiceError, invalid_argument
from services.reception.http.errors import as_http_error
from services.reception.http.json_answers import json_answer


def _answer(call, **kwargs) -> tuple[int, dict]:
    response = asyncio.run(json_answer(call, as_http_error, **kwargs))
    return response.status_code, json.loads(response.body)


def test_the_calls_body_is_answered_with_the_routes_status():
    async def call():
        return {"id": "ftjob-1", "status": "PENDING"}

    assert _answer(call) == (200, {"id": "ftjob-1", "status": "PENDING"})
    assert _answer(call, status=201)[0] == 201


def test_a_refusal_is_openais_error_body_naming_the_field():
    async def call():
        raise invalid_argument("hyperparameters.epochs", "must be at least 1, got 0")

    status, body = _answer(call, status=201)
    assert status == 400
    assert body == {
        "error": {
            "message": "hyperparameters.epochs: must be at least 1, got 0",
            "type": "invalid_request_error",
            "param": "hyperparameters.epochs",
            "code": "invalid_argument",
        }
    }


def test_the_route_restates_the_error_before_it_is_answered():
    async def call():
        raise invalid_argument("hyperparameters.epochs", "must be at least 1, got 0")

    def renamed(error: Exception) -> BaseException:
        assert isinstance(error, ServiceError)
        return ServiceError(error.code, "n_epochs: must be at least 1", [("hyperparameters.n_epochs", "bad")])

    status, body = _answer(call, restate=renamed)
    assert status == 400 and body["error"]["param"] == "hyperparameters.n_epochs"


def test_not_found_and_a_bug_keep_their_statuses_and_a_cancel_propagates():
    async def missing():
        raise ServiceError(grpc.StatusCode.NOT_FOUND, "no training job ftjob-x")

    assert _answer(missing) == (
        404,
        {
            "error": {
                "message": "no training job ftjob-x",
                "type": "invalid_request_error",
                "param": None,
                "code": "not_found",
            }
        },
    )

    async def bug():
        raise KeyError("oops")

    status, body = _answer(bug)
    assert status == 500 and body["error"]["code"] == "internal" and "oops" not in body["error"]["message"]

    async def cancelled():
        raise asyncio.CancelledError

    with pytest.raises(asyncio.CancelledError):
        _answer(cancelled)
