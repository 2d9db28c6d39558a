"""The OpenAI request fields reception accepts and ignores: the one list of them. Each changes
nothing a model answers here, so refusing it would only break clients that send it by habit (an
agent replaying its settings); each one a request carries is named in the answer's
`x-expert-ignored-fields` header, in one log line and in `expert_reception_ignored_fields_total`.

A field not on this list that the API does not know stays refused (400, code `unknown_parameter`):
a misspelt field (`max_token`) or one whose meaning we would change by ignoring it must not pass
silently. Fields that ask for something we cannot do are refused too, not listed here: `audio` and
`modalities` other than text, `web_search_options`, a non-empty `logit_bias`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from libs.logging import get_logger

log = get_logger(__name__)

IGNORED_FIELDS_HEADER = "x-expert-ignored-fields"


class IgnoredFields(BaseModel):
    """The ignored fields, typed as OpenAI documents them (a wrong type is still a 400)."""

    model_config = ConfigDict(extra="forbid")

    store: StrictBool | None = None  # OpenAI keeps the completion for its dashboard: we keep no such store
    metadata: dict[str, str] | None = None  # tags for that store
    service_tier: str | None = None  # OpenAI's billing tier: there is one tier here
    reasoning_effort: str | None = None  # o-series models only: the models here do not reason apart
    prediction: dict[str, Any] | None = None  # predicted output, a latency hint: the answer is the same
    modalities: list[Literal["text"]] | None = None  # text is all we make (audio is refused)
    prompt_cache_key: str | None = None  # a cache hint: our prefix cache needs none
    safety_identifier: str | None = Field(None, max_length=512)  # an end-user id for OpenAI's abuse checks


NAMES = tuple(IgnoredFields.model_fields)


def ignored(body: BaseModel) -> list[str]:
    """The ignored fields `body` carries (set to anything but null), in the list's order."""
    return [name for name in NAMES if name in body.model_fields_set and getattr(body, name) is not None]


def report_ignored(body: BaseModel, metrics) -> dict[str, str]:
    """Logs and counts the fields of `body` that are ignored; the header that names them ({} if none)."""
    names = ignored(body)
    if not names:
        return {}
    log.info("ignored request fields", fields=names)
    if metrics is not None:
        for name in names:
            metrics.ignored_fields.labels(name).inc()
    return {IGNORED_FIELDS_HEADER: ", ".join(names)}
