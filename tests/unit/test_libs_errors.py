"""libs.errors: ServiceError constructors, and the BadRequest field violations surviving a round trip
through a real grpc.aio server to an aio and a sync client."""

from __future__ import annotations

import asyncio
import base64
import urllib.parse

import grpc
import pytest

from libs import errors
from libs.errors import ServiceError, describe, field_violations, invalid_argument, to_status
from libs.gen.expert.v1 import router_pb2, router_pb2_grpc

TEMPERATURE = ("request.temperature", "must be in [0, 2], got 3")


ERRORS = {
    "temperature": invalid_argument(*TEMPERATURE),
    "two": errors.invalid_arguments([TEMPERATURE, ("request.top_k", "must be at least 0, got -1")]),
    "missing": errors.not_found("job j-1 not found"),
    # a thousand problems, each echoing a long value in several scripts: far over 16 KiB unclipped
    "many": errors.invalid_arguments(
        [(f"request.force_experts[{i}]", "unknown expert " + "é€𝄞x" * 200) for i in range(1000)]
    ),
    "echo": errors.not_found("job " + "𝄞" * 100_000 + " does not exist"),
    "limited": errors.resource_exhausted("API key k is over its limit", retry_after_s=12),
}


class _Refusing(router_pb2_grpc.RouterServiceServicer):
    """Answers every Plan with the ServiceError named by the job id."""

    async def Plan(self, request, context):
        await context.abort_with_status(to_status(ERRORS[request.job_id]))


async def _with_server(check):
    server = grpc.aio.server()
    router_pb2_grpc.add_RouterServiceServicer_to_server(_Refusing(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        return await check(f"127.0.0.1:{port}")
    finally:
        await server.stop(None)


async def _aio_error(target: str, job_id: str) -> grpc.aio.AioRpcError:
    async with grpc.aio.insecure_channel(target) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await router_pb2_grpc.RouterServiceStub(channel).Plan(
                router_pb2.PlanRequest(job_id=job_id), timeout=5
            )
    return raised.value


@pytest.mark.parametrize(
    ("make", "code"),
    [
        (lambda: errors.not_found("m"), grpc.StatusCode.NOT_FOUND),
        (lambda: errors.resource_exhausted("m"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (lambda: errors.unavailable("m"), grpc.StatusCode.UNAVAILABLE),
        (lambda: errors.failed_precondition("m"), grpc.StatusCode.FAILED_PRECONDITION),
        (lambda: errors.unauthenticated("m"), grpc.StatusCode.UNAUTHENTICATED),
        (lambda: errors.permission_denied("m"), grpc.StatusCode.PERMISSION_DENIED),
    ],
)
def test_each_constructor_carries_its_code_and_message(make, code):
    error = make()
    assert (error.code, error.message, error.violations) == (code, "m", ())
    assert str(error) == f"{code.name}: m"


def test_invalid_argument_names_the_field_in_its_message():
    error = invalid_argument(*TEMPERATURE)
    assert error.code is grpc.StatusCode.INVALID_ARGUMENT
    assert error.message == "request.temperature: must be in [0, 2], got 3"
    assert error.violations == (TEMPERATURE,)
    assert describe(error) == "INVALID_ARGUMENT: request.temperature: must be in [0, 2], got 3"


def test_invalid_arguments_needs_a_violation_and_ok_is_not_an_error():
    with pytest.raises(ValueError):
        errors.invalid_arguments([])
    with pytest.raises(ValueError):
        ServiceError(grpc.StatusCode.OK, "fine")


def test_to_status_puts_the_message_in_the_details():
    status = to_status(invalid_argument(*TEMPERATURE))
    assert status.code is grpc.StatusCode.INVALID_ARGUMENT
    assert status.details == "request.temperature: must be in [0, 2], got 3"
    assert [key for key, _ in status.trailing_metadata] == ["grpc-status-details-bin"]


def test_an_aio_client_reads_the_field_violation():
    async def check(target):
        error = await _aio_error(target, "temperature")
        assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert field_violations(error) == [TEMPERATURE]
        assert describe(error) == "INVALID_ARGUMENT: request.temperature: must be in [0, 2], got 3"

    asyncio.run(_with_server(check))


def test_a_retry_delay_reaches_the_client_as_retry_info():
    async def check(target):
        limited = await _aio_error(target, "limited")
        assert limited.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert errors.retry_delay(limited) == 12.0
        assert field_violations(limited) == []
        assert errors.retry_delay(await _aio_error(target, "temperature")) is None

    asyncio.run(_with_server(check))


def test_an_error_has_violations_or_a_retry_delay_not_both():
    with pytest.raises(ValueError):
        ServiceError(grpc.StatusCode.INVALID_ARGUMENT, "m", [TEMPERATURE], retry_after_s=1.0)


def test_several_violations_arrive_in_order():
    async def check(target):
        error = await _aio_error(target, "two")
        assert field_violations(error) == [TEMPERATURE, ("request.top_k", "must be at least 0, got -1")]

    asyncio.run(_with_server(check))


def test_a_thousand_violations_reach_the_client_as_the_first_ones_and_a_count():
    async def check(target):
        error = await _aio_error(target, "many")
        assert error.code() is grpc.StatusCode.INVALID_ARGUMENT  # not "metadata size exceeds hard limit"
        violations = field_violations(error)
        assert [field for field, _ in violations] == [
            f"request.force_experts[{i}]" for i in range(errors.MAX_VIOLATIONS_SENT)
        ]
        assert all(description.endswith("…") for _, description in violations)
        assert error.details().startswith("1000 problems, the first 10: request.force_experts[0]: ")

    asyncio.run(_with_server(check))


def test_a_huge_message_is_clipped_not_lost():
    async def check(target):
        error = await _aio_error(target, "echo")
        assert error.code() is grpc.StatusCode.NOT_FOUND
        assert error.details().startswith("job 𝄞") and error.details().endswith("…")

    asyncio.run(_with_server(check))


@pytest.mark.parametrize("name", ["many", "echo"])
def test_the_worst_errors_stay_under_the_clients_soft_metadata_limit(name):
    # Between 8 and 16 KiB a client refuses metadata at random, so this is checked by size, not by
    # a round trip that would pass most of the time.
    status = to_status(ERRORS[name])
    message_bytes = len(urllib.parse.quote(status.details, safe=" !\"#$&'()*+,-./:;<=>?@[\\]^_`{|}~"))
    details_bytes = sum(len(base64.b64encode(value)) for _, value in status.trailing_metadata)
    assert message_bytes + details_bytes + 200 < errors.METADATA_SOFT_LIMIT  # 200: the other headers


def test_the_count_of_hidden_violations_is_in_the_message():
    error = errors.invalid_arguments([(f"f{i}", "bad") for i in range(25)])
    assert error.message.startswith("25 problems, the first 10: f0: bad; f1: bad")
    assert len(error.violations) == 25  # all kept on the server side, for metrics and logs


def test_clip_cuts_on_a_character_boundary():
    assert errors.clip("abc", 3) == "abc"
    assert errors.clip("é" * 10, 8) == "éé…"  # 4 bytes of "é" + 3 of "…"
    assert len(errors.clip("𝄞" * 10, 9).encode()) <= 9


def test_a_sync_client_reads_the_field_violation_too():
    def call(target):
        with grpc.insecure_channel(target) as channel:
            stub = router_pb2_grpc.RouterServiceStub(channel)
            with pytest.raises(grpc.RpcError) as raised:
                stub.Plan(router_pb2.PlanRequest(job_id="temperature"), timeout=5)
        return raised.value

    async def check(target):
        error = await asyncio.to_thread(call, target)
        assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert field_violations(error) == [TEMPERATURE]

    asyncio.run(_with_server(check))


def test_an_error_without_details_has_no_violations():
    async def check(target):
        error = await _aio_error(target, "missing")
        assert field_violations(error) == []
        assert describe(error) == "NOT_FOUND: job j-1 not found"

    asyncio.run(_with_server(check))


def test_describe_keeps_to_one_line_and_handles_other_exceptions():
    assert describe(errors.not_found("line one\nline two")) == "NOT_FOUND: line one line two"
    assert describe(KeyError("x")) == "KeyError: 'x'"
