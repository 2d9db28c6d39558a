"""The fleet's capacity as reception sees it: the dispatcher pulls jobs only while an engine slot is
free, and admission, validation and planning read the served models from the same answer."""

from __future__ import annotations

import asyncio
import time

import grpc

from libs.errors import invalid_argument
from libs.gen.expert.v1 import common_pb2, preparation_pb2
from libs.grpc_client import call
from libs.logging import get_logger

log = get_logger(__name__)


class Capacity:
    """Preparation's GetCapacity, cached briefly so that idle workers do not hammer it."""

    def __init__(self, preparation, ttl_s: float = 0.05) -> None:
        self.preparation = preparation
        self.ttl_s = ttl_s
        self._value = preparation_pb2.GetCapacityResponse()
        self._at = 0.0
        self._lock = asyncio.Lock()

    async def get(self) -> preparation_pb2.GetCapacityResponse:
        async with self._lock:
            if time.monotonic() - self._at > self.ttl_s:
                try:
                    self._value = await call(
                        self.preparation.GetCapacity,
                        preparation_pb2.GetCapacityRequest(),
                        timeout=2.0,
                        idempotent=True,
                    )
                except grpc.aio.AioRpcError as exc:
                    log.warning("preparation unreachable", error=exc.details())
                    self._value = preparation_pb2.GetCapacityResponse()
                self._at = time.monotonic()
            return self._value

    def invalidate(self) -> None:
        self._at = 0.0

    @property
    def last(self) -> preparation_pb2.GetCapacityResponse:
        """The latest answer, without asking again."""
        return self._value


def served_model(
    capacity: preparation_pb2.GetCapacityResponse, request: common_pb2.InferenceRequest
) -> common_pb2.ServedModel | None:
    """The model the request runs on: the one it names, else the fleet's default (the first to
    register). None while no engine is registered (the job waits for one). A model no engine
    serves is INVALID_ARGUMENT on request.model, so that the job fails at once instead of waiting
    for an engine that is not coming."""
    if not capacity.models:
        return None
    if not request.HasField("model"):
        return capacity.models[0]
    for model in capacity.models:
        if model.name == request.model:
            return model
    served = ", ".join(m.name for m in capacity.models)
    raise invalid_argument(
        "request.model", f"no engine serves the model {request.model!r} (served: {served})"
    )
