"""The base models the fleet serves and the experts the router has registered, for GET /v1/models
and the `model` field (`<base>` or `<base>:<expert>`)."""

from __future__ import annotations

import asyncio
import time

import grpc

from libs.gen.expert.v1 import preparation_pb2, router_pb2
from libs.grpc_client import call
from libs.logging import get_logger

log = get_logger(__name__)


MODELS_TTL_S = 2.0  # how long a list (served models, registered experts) is reused before it is asked again


class ServedModels:
    """The base models the fleet serves (each engine's model name, from preparation's ListEngines)
    and the experts registered (the router's ListRegisteredExperts), each list reused for
    MODELS_TTL_S."""

    def __init__(self, preparation, router=None) -> None:
        self.preparation = preparation
        self.router = router
        self._names: list[str] = []
        self._at = float("-inf")
        self._lock = asyncio.Lock()
        self._experts: list[str] = []
        self._experts_at = float("-inf")
        self._experts_lock = asyncio.Lock()

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

    async def experts(self) -> list[str]:
        """The names of the experts registered with the router, sorted (none without a router)."""
        if self.router is None:
            return []
        async with self._experts_lock:
            if time.monotonic() - self._experts_at > MODELS_TTL_S:
                try:
                    response = await call(
                        self.router.ListRegisteredExperts,
                        router_pb2.ListRegisteredExpertsRequest(),
                        timeout=2.0,
                        idempotent=True,
                    )
                    self._experts = sorted({e.name for e in response.experts if e.name})
                except grpc.aio.AioRpcError as exc:
                    log.warning("router unreachable", error=exc.details())
                    self._experts = []
                self._experts_at = time.monotonic()
            return self._experts
