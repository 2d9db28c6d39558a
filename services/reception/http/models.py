"""The base models the fleet serves, for GET /v1/models and the `model` field."""

from __future__ import annotations

import asyncio
import time

import grpc

from libs.gen.expert.v1 import preparation_pb2
from libs.grpc_client import call
from libs.logging import get_logger

log = get_logger(__name__)


MODELS_TTL_S = 2.0  # how long the list of served models is reused before preparation is asked again


class ServedModels:
    """The base models the fleet serves (each engine's model name, from preparation's ListEngines),
    reused for MODELS_TTL_S."""

    def __init__(self, preparation) -> None:
        self.preparation = preparation
        self._names: list[str] = []
        self._at = float("-inf")
        self._lock = asyncio.Lock()

    def last(self) -> str | None:
        """The fleet's model as last listed, without asking (None: not listed yet, or several)."""
        return self._names[0] if len(self._names) == 1 else None

    async def names(self) -> list[str]:
        async with self._lock:
            if time.monotonic() - self._at > MODELS_TTL_S:
                try:
                    response = await call(
                        self.preparation.ListEngines,
                        preparation_pb2.ListEnginesRequest(),
                        timeout=2.0,
                        idempotent=True,
                    )
                    self._names = sorted({e.model.name for e in response.engines if e.model.name})
                except grpc.aio.AioRpcError as exc:
                    log.warning("preparation unreachable", error=exc.details())
                    self._names = []
                self._at = time.monotonic()
            return self._names
