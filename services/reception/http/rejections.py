"""The HTTP front's refusals counted in `expert_reception_requests_rejected_total`, with the labels
gRPC's refusals get (ReceptionMetrics.refused owns them): the field to blame as gRPC names it
(`request.temperature`), or what was refused when no field is (the body, the credentials, a rate).
What admission refuses (validation, a key over its limits) is counted there, for both fronts; this
counts what the HTTP front refuses before a request reaches admission."""

from __future__ import annotations

from services.reception.http.errors import HttpError
from services.reception.metrics import (
    REFUSED_BODY,
    REFUSED_CREDENTIALS,
    REFUSED_RATE,
    REFUSED_UNKNOWN_FIELD,
    ReceptionMetrics,
)

# The statuses of a refused request (not of an unknown path or method, nor of a failure of ours).
_REFUSALS = {400, 401, 403, 404, 413, 415, 422, 429}


def refused_field(error: HttpError) -> str:
    """The `field` label of a refusal."""
    if error.status in (401, 403):
        return REFUSED_CREDENTIALS
    if error.status == 429:
        return REFUSED_RATE
    if error.code == "unknown_parameter":
        return REFUSED_UNKNOWN_FIELD  # the name is the client's: never a label of its own
    return f"request.{error.param}" if error.param else REFUSED_BODY


def count_refusal(metrics: ReceptionMetrics | None, error: HttpError) -> None:
    if metrics is not None and error.status in _REFUSALS:
        metrics.refused(refused_field(error))
