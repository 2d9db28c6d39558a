"""gRPC errors as AIP-193 wants them: a status code, a message for humans and, for bad input,
`google.rpc.BadRequest` field violations that name each offending field; a refusal the client may
retry later (a rate limit) carries a `google.rpc.RetryInfo` with the delay to wait.

Servers raise `ServiceError` (built by `invalid_argument`, `not_found`, ...) from a servicer; the
interceptor of `libs.grpc_server` turns it into the status with `to_status`. Clients read a
received error with `field_violations` and `describe`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

# The trailing-metadata key that carries a serialized google.rpc.Status.
_DETAILS_KEY = "grpc-status-details-bin"

# An error travels in trailing metadata. gRPC clients refuse metadata over 16 KiB, and refuse it at
# random between 8 and 16 KiB (the soft limit, grpc.max_metadata_size), seeing RESOURCE_EXHAUSTED
# instead of the error. A request with a thousand problems, or one that echoes a megabyte of user
# text, is therefore sent as its first violations, each clipped, and a count, always under 8 KiB:
# the message is sent twice, percent-encoded in grpc-message (up to 3 bytes per byte) and inside
# the base64 details, so at worst 3 x 512 + 4/3 x (512 + 10 x ~300) bytes, about 6.2 KB. A RetryInfo
# (about 20 bytes) is only sent without violations, so it never adds to that worst case.
METADATA_SOFT_LIMIT = 8 * 1024
MAX_VIOLATIONS_SENT = 10
_MAX_FIELD_BYTES = 96
_MAX_DESCRIPTION_BYTES = 192
_MAX_MESSAGE_BYTES = 512
# The codes that say the request is wrong rather than a service: a job a stage refused with one of
# them fails its client's call with that code, and an engine that answers one is not blamed for it.
CLIENT_ERRORS = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.OUT_OF_RANGE,
    }
)


class ServiceError(Exception):
    """An error to send to the client as status `code` with `message`; `violations` lists
    (field, description) pairs, sent as a BadRequest detail (INVALID_ARGUMENT only, by convention);
    `retry_after_s`, when set, is sent as a RetryInfo detail (RESOURCE_EXHAUSTED, UNAVAILABLE)."""

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        violations: Sequence[tuple[str, str]] = (),
        *,
        retry_after_s: float | None = None,
    ) -> None:
        if code is grpc.StatusCode.OK:
            raise ValueError("a ServiceError cannot carry status OK")
        if violations and retry_after_s is not None:
            raise ValueError("a ServiceError carries field violations or a retry delay, not both")
        super().__init__(message)
        self.code = code
        self.message = message
        self.violations: tuple[tuple[str, str], ...] = tuple(violations)
        self.retry_after_s = retry_after_s

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"


def is_client_error(code: grpc.StatusCode) -> bool:
    """Whether `code` is the client's fault (CLIENT_ERRORS), not a service's."""
    return code in CLIENT_ERRORS


def invalid_argument(field: str, description: str) -> ServiceError:
    """INVALID_ARGUMENT for one bad field, e.g. `invalid_argument("request.temperature",
    "must be in [0, 2], got 3")`; the message reads "request.temperature: must be in [0, 2], got 3"."""
    return invalid_arguments([(field, description)])


def invalid_arguments(violations: Iterable[tuple[str, str]]) -> ServiceError:
    """INVALID_ARGUMENT for several bad fields at once; the message joins them with "; "."""
    pairs = list(violations)
    if not pairs:
        raise ValueError("invalid_arguments needs at least one (field, description)")
    shown = pairs[:MAX_VIOLATIONS_SENT]
    message = "; ".join(f"{field}: {description}" for field, description in shown)
    if len(pairs) > len(shown):  # the count first, so that clipping the message keeps it
        message = f"{len(pairs)} problems, the first {len(shown)}: {message}"
    return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, message, pairs)


def not_found(message: str) -> ServiceError:
    """NOT_FOUND: an unknown job, expert, engine or session."""
    return ServiceError(grpc.StatusCode.NOT_FOUND, message)


def resource_exhausted(message: str, retry_after_s: float | None = None) -> ServiceError:
    """RESOURCE_EXHAUSTED: overload or a quota; the client may retry later, after `retry_after_s`
    seconds when given (sent as a RetryInfo detail)."""
    return ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, message, retry_after_s=retry_after_s)


def unauthenticated(message: str) -> ServiceError:
    """UNAUTHENTICATED: no credentials, or credentials that are wrong or revoked."""
    return ServiceError(grpc.StatusCode.UNAUTHENTICATED, message)


def permission_denied(message: str) -> ServiceError:
    """PERMISSION_DENIED: valid credentials that do not allow this call (e.g. an infer-scope key
    calling an admin RPC)."""
    return ServiceError(grpc.StatusCode.PERMISSION_DENIED, message)


def unavailable(message: str) -> ServiceError:
    """UNAVAILABLE: a transient failure (a peer down, not ready yet); safe to retry."""
    return ServiceError(grpc.StatusCode.UNAVAILABLE, message)


def failed_precondition(message: str) -> ServiceError:
    """FAILED_PRECONDITION: the system is not in the state the request needs (e.g. the job is final)."""
    return ServiceError(grpc.StatusCode.FAILED_PRECONDITION, message)


def clip(text: str, max_bytes: int) -> str:
    """`text` cut to at most `max_bytes` of UTF-8 (on a character boundary), marked with "…"."""
    data = text.encode()
    if len(data) <= max_bytes:
        return text
    return data[: max_bytes - 3].decode(errors="ignore") + "…"


def to_status(error: ServiceError) -> grpc.Status:
    """The `grpc.Status` to abort with (`context.abort_with_status`): the code, the message, and a
    google.rpc.Status in the trailing metadata with a BadRequest detail when there are violations.
    Both are bounded (MAX_VIOLATIONS_SENT, clipped texts) so that they always reach the client."""
    status = status_pb2.Status(code=error.code.value[0], message=clip(error.message, _MAX_MESSAGE_BYTES))
    if error.violations:
        bad_request = error_details_pb2.BadRequest(
            field_violations=[
                error_details_pb2.BadRequest.FieldViolation(
                    field=clip(field, _MAX_FIELD_BYTES), description=clip(description, _MAX_DESCRIPTION_BYTES)
                )
                for field, description in error.violations[:MAX_VIOLATIONS_SENT]
            ]
        )
        detail = any_pb2.Any()
        detail.Pack(bad_request)
        status.details.append(detail)
    if error.retry_after_s is not None:
        retry_info = error_details_pb2.RetryInfo()
        retry_info.retry_delay.FromNanoseconds(max(0, round(error.retry_after_s * 1e9)))
        detail = any_pb2.Any()
        detail.Pack(retry_info)
        status.details.append(detail)
    return rpc_status.to_status(status)


def _rich_status(error: grpc.RpcError) -> status_pb2.Status | None:
    # grpc_status.rpc_status.from_call wants a sync grpc.Call and raises when code or message
    # differ; a received error (sync or aio) only promises trailing_metadata(), so read it here.
    trailing = getattr(error, "trailing_metadata", None)
    metadata = trailing() if callable(trailing) else None
    for key, value in metadata or ():
        if key == _DETAILS_KEY and isinstance(value, bytes):
            try:
                return status_pb2.Status.FromString(value)
            except Exception:
                return None
    return None


def field_violations(error: grpc.RpcError) -> list[tuple[str, str]]:
    """The (field, description) pairs of the BadRequest detail of a received error (from a sync or
    an aio call); empty when it has none."""
    status = _rich_status(error)
    if status is None:
        return []
    violations: list[tuple[str, str]] = []
    for detail in status.details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad_request = error_details_pb2.BadRequest()
            detail.Unpack(bad_request)
            violations.extend((v.field, v.description) for v in bad_request.field_violations)
    return violations


def retry_delay(error: grpc.RpcError) -> float | None:
    """The seconds a received error's RetryInfo detail asks to wait before retrying; None without one."""
    status = _rich_status(error)
    for detail in status.details if status is not None else ():
        if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            retry_info = error_details_pb2.RetryInfo()
            detail.Unpack(retry_info)
            return retry_info.retry_delay.ToNanoseconds() / 1e9
    return None


def _code_and_message(error: BaseException) -> tuple[grpc.StatusCode | None, str]:
    if isinstance(error, ServiceError):
        return error.code, error.message
    code = getattr(error, "code", None)
    details = getattr(error, "details", None)
    if callable(code) and callable(details):
        return code(), details() or ""
    return None, str(error)


def describe(error: BaseException) -> str:
    """One line for humans: "INVALID_ARGUMENT: request.temperature: must be in [0, 2], got 3" for a
    received gRPC error or a ServiceError; the exception's type and text for anything else."""
    code, message = _code_and_message(error)
    if isinstance(error, grpc.RpcError) and not message:
        message = "; ".join(f"{field}: {description}" for field, description in field_violations(error))
    message = " ".join(message.split())
    if code is None:
        return f"{type(error).__name__}: {message}" if message else type(error).__name__
    return f"{code.name}: {message}" if message else code.name
