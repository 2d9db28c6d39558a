"""How a stage step of a job's saga can end other than with its answer."""

from __future__ import annotations

import grpc


class JobStopped(Exception):
    """The job's deadline passed or it was cancelled."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason  # "timeout" | "cancelled"


class JobFailed(Exception):
    """A stage refused or could not run the job."""

    def __init__(
        self, message: str, code: grpc.StatusCode, fields: list[tuple[str, str]] | None = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.fields = fields or []


class EngineLost(Exception):
    """The engine stream failed for a reason other than the request: the job runs again as a new
    attempt. `broken`: the failure is evidence about the engine (the connection broke, the process
    went away, the stream ended without its last message), which preparation is told of; otherwise
    the engine answered (an INTERNAL error, say) and is left alone."""

    def __init__(self, message: str, broken: bool = True) -> None:
        super().__init__(message)
        self.broken = broken
