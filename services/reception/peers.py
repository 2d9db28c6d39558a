"""Channels and stubs to the other stages, opened once and shared by every dispatcher worker."""

from __future__ import annotations

import grpc

from libs.gen.expert.v1 import postproc_pb2_grpc, preparation_pb2_grpc, router_pb2_grpc
from libs.grpc_client import insecure_channel


class Peers:
    def __init__(self, router_target: str, preparation_target: str, postproc_target: str) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.router = router_pb2_grpc.RouterServiceStub(self._channel(router_target))
        self.preparation = preparation_pb2_grpc.PreparationServiceStub(self._channel(preparation_target))
        self.postproc = postproc_pb2_grpc.PostprocServiceStub(self._channel(postproc_target))

    def _channel(self, target: str) -> grpc.aio.Channel:
        channel = self._channels.get(target)
        if channel is None:
            channel = self._channels[target] = insecure_channel(target)
        return channel

    def engine_channel(self, address: str) -> grpc.aio.Channel:
        """The channel to an engine, by the address it registered (engines come and go)."""
        return self._channel(address)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
