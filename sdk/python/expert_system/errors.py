"""The SDK's exceptions: one per gRPC status a caller reacts to, built from a failed call.

The services report bad input as INVALID_ARGUMENT with a google.rpc.BadRequest detail (AIP-193);
its field violations become `field_violations`, so a caller can point at the offending field. A
refusal to retry later (an API key over its limit) carries a google.rpc.RetryInfo: `retry_after`.
"""

from __future__ import annotations

import grpc
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status


class ExpertSystemError(Exception):
    """A call to the Expert System failed. `code` is the gRPC status name ("INVALID_ARGUMENT"),
    `message` the server's description, `field_violations` the (field, description) pairs of a
    google.rpc.BadRequest detail (empty without one), `retry_after` the seconds a google.rpc.RetryInfo
    detail asks to wait before retrying (None without one)."""

    def __init__(
        self,
        code: str,
        message: str,
        field_violations: list[tuple[str, str]] | None = None,
        retry_after: float | None = None,
    ):
        self.code = code
        self.message = message
        self.field_violations = list(field_violations or [])
        self.retry_after = retry_after
        super().__init__(f"{code}: {message}" if message else code)


class InvalidRequest(ExpertSystemError):
    """INVALID_ARGUMENT: the request was refused; `field_violations` says why, field by field."""


class NotFound(ExpertSystemError):
    """NOT_FOUND: no such job (or expert)."""


class FailedPrecondition(ExpertSystemError):
    """FAILED_PRECONDITION: the request can never run as asked (e.g. it needs more KV cache than
    any engine holds); change the request rather than retry it."""


class Unavailable(ExpertSystemError):
    """UNAVAILABLE: the service could not be reached or failed transiently; retrying may work."""


class DeadlineExceeded(ExpertSystemError):
    """DEADLINE_EXCEEDED: the call's `timeout` elapsed before the answer came."""


class ResourceExhausted(ExpertSystemError):
    """RESOURCE_EXHAUSTED: the system is overloaded, a message was too large, or the API key is over
    its requests or tokens per minute (then `retry_after` says how long to wait)."""


class Unauthenticated(ExpertSystemError):
    """UNAUTHENTICATED: the API key is missing, wrong or revoked (see `ExpertClient(api_key=...)`)."""


class PermissionDenied(ExpertSystemError):
    """PERMISSION_DENIED: the API key is valid but its scope does not allow this call."""


_BY_CODE: dict[grpc.StatusCode, type[ExpertSystemError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
}


def error_from_status(
    code: grpc.StatusCode, details: str | None, rich_status: status_pb2.Status | None
) -> ExpertSystemError:
    """The exception for a call that ended with `code`, `details` and (if sent) a rich status."""
    violations: list[tuple[str, str]] = []
    retry_after = None
    if rich_status is not None:
        for detail in rich_status.details:
            if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
                bad_request = error_details_pb2.BadRequest()
                detail.Unpack(bad_request)
                violations.extend((v.field, v.description) for v in bad_request.field_violations)
            elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
                retry_info = error_details_pb2.RetryInfo()
                detail.Unpack(retry_info)
                retry_after = retry_info.retry_delay.ToNanoseconds() / 1e9
    cls = _BY_CODE.get(code, ExpertSystemError)
    return cls(code.name, details or "", violations, retry_after)


def error_from_call(call: grpc.Call) -> ExpertSystemError:
    """The exception for a failed synchronous call (a `grpc.RpcError` is also its `grpc.Call`)."""
    try:
        rich = rpc_status.from_call(call)
    except ValueError:  # a rich status that contradicts the call's own status: ignore the details
        rich = None
    return error_from_status(call.code(), call.details(), rich)


async def error_from_aio_call(call: grpc.aio.Call) -> ExpertSystemError:
    """The exception for a failed `grpc.aio` call."""
    try:
        rich = await rpc_status.aio.from_call(call)
    except ValueError:
        rich = None
    return error_from_status(await call.code(), await call.details(), rich)
