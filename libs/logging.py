"""JSON-lines logging for the services: structlog for our code, the stdlib `logging` of libraries
(grpc, redis, asyncio) routed through the same renderer, and context binding so that `job_id` and
`request_id` appear on every line logged while a job or an RPC is handled.

Every line is one JSON object on stdout with at least `timestamp` (ISO 8601, UTC), `level`,
`event` and `service`; `logger` names the module that logged it.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Mapping
from contextvars import Token
from types import TracebackType
from typing import Any

import structlog
from structlog.types import EventDict, Processor, WrappedLogger

LEVELS: Mapping[str, int] = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}

# The handler this module installed on the root logger, so reconfiguring replaces it instead of
# printing every line twice.
_handler: logging.Handler | None = None


def configure_logging(service: str, level: str = "info") -> None:
    """Sends every log line, ours and the libraries', as JSON to stdout with `service` bound and
    records below `level` (debug, info, warning, error, critical) dropped. Calling it again
    replaces the previous configuration (tests do)."""
    global _handler
    try:
        numeric_level = LEVELS[level.lower()]
    except KeyError:
        raise ValueError(f"log level must be one of {', '.join(LEVELS)}, got {level!r}") from None

    def add_service(_logger: WrappedLogger, _method: str, event: EventDict) -> EventDict:
        event.setdefault("service", service)
        return event

    # Shared by structlog events and by stdlib records ("foreign" to structlog), so both render
    # with the same keys.
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True, key="timestamp"),
        add_service,
    ]
    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            *shared,
            structlog.stdlib.PositionalArgumentsFormatter(),
            structlog.processors.StackInfoRenderer(),
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        # Not cached: a module-level logger first used before this call (or before a test
        # reconfigured logging) would otherwise keep the configuration of that moment.
        cache_logger_on_first_use=False,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            # A traceback becomes one string field: the line stays one JSON object.
            structlog.processors.format_exc_info,
            structlog.processors.UnicodeDecoder(),
            structlog.processors.JSONRenderer(default=str),
        ],
    )
    handler = _StdoutHandler()
    handler.setFormatter(formatter)
    root = logging.getLogger()
    if _handler is not None:
        root.removeHandler(_handler)
    root.addHandler(handler)
    root.setLevel(numeric_level)
    _handler = handler


class _StdoutHandler(logging.StreamHandler):
    # Looks sys.stdout up at each write rather than once: whoever replaces it later (pytest's
    # capture, a redirect) still gets the lines, and no line goes to a closed stream.
    def __init__(self) -> None:
        super().__init__(sys.stdout)

    @property
    def stream(self):  # type: ignore[override]
        return sys.stdout

    @stream.setter
    def stream(self, _value: object) -> None:
        pass


def is_configured() -> bool:
    """Whether `configure_logging` has run in this process."""
    return _handler is not None


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    """A structlog logger named `name` (usually `__name__`); it renders as configured by
    `configure_logging`, whenever that is called."""
    return structlog.stdlib.get_logger(name)


class BoundContext:
    """Key-values bound to the current context (the running task and the tasks it creates) by
    `bind_context`; `reset()` or leaving the `with` block unbinds them."""

    def __init__(self, tokens: Mapping[str, Token[Any]]) -> None:
        self._tokens = dict(tokens)

    def reset(self) -> None:
        """Restores the values the keys had before `bind_context`."""
        tokens, self._tokens = self._tokens, {}
        for key, token in tokens.items():
            # ValueError: the token belongs to another context (an async generator finalized
            # outside the task that bound it); that context is gone, there is nothing to restore.
            with contextlib.suppress(ValueError):
                structlog.contextvars.reset_contextvars(**{key: token})

    def __enter__(self) -> BoundContext:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.reset()


def bind_context(**values: Any) -> BoundContext:
    """Binds `values` (e.g. `job_id=...`, `request_id=...`) to every line logged from the current
    context until reset; None values are skipped. Use as `with bind_context(job_id=id): ...` or keep
    the returned object and call `reset()`. Tasks created meanwhile inherit the binding."""
    present = {key: value for key, value in values.items() if value is not None}
    return BoundContext(structlog.contextvars.bind_contextvars(**present))
