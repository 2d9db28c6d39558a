"""The models GET /v1/models lists: each base model the fleet serves (from the capacity answer the
dispatcher keeps fresh), then `<base>:<expert>` for each registered expert whose weights fit it."""

from __future__ import annotations

import asyncio
import time

import grpc

from libs.gen.expert.v1 import router_pb2
from libs.grpc_client import call
from libs.logging import get_logger
from services.reception.capacity import Capacity

log = get_logger(__name__)


EXPERTS_TTL_S = 2.0  # how long the router's list of registered experts is reused before it is asked again


class ServedModels:
    """The served base models (`capacity`'s models) and the experts registered with the router
    (ListRegisteredExperts, reused for EXPERTS_TTL_S)."""

    def __init__(self, capacity: Capacity, router=None) -> None:
        self.capacity = capacity
        self.router = router
        self._experts: list[router_pb2.RegisteredExpert] = []
        self._experts_at = float("-inf")
        self._experts_lock = asyncio.Lock()

    async def names(self) -> list[str]:
        """Each base model, then `<base>:<expert>` for each registered expert that fits it."""
        models = (await self.capacity.get()).models
        experts = await self._registered() if models else []
        names = [m.name for m in models]
        for model in models:
            names += [
                f"{model.name}:{e.name}"
                for e in experts
                if not e.base_model_hash
                or not model.base_model_hash
                or e.base_model_hash == model.base_model_hash
            ]
        return names

    async def _registered(self) -> list[router_pb2.RegisteredExpert]:
        if self.router is None:
            return []
        async with self._experts_lock:
            if time.monotonic() - self._experts_at > EXPERTS_TTL_S:
                try:
                    response = await call(
                        self.router.ListRegisteredExperts,
                        router_pb2.ListRegisteredExpertsRequest(),
                        timeout=2.0,
                        idempotent=True,
                    )
                    self._experts = sorted(response.experts, key=lambda e: e.name)
                except grpc.aio.AioRpcError as exc:
                    log.warning("router unreachable", error=exc.details())
                    self._experts = []
                self._experts_at = time.monotonic()
            return self._experts
