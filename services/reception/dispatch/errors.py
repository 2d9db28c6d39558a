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
    """The engine stream broke for a reason other than the request: try another engine."""
