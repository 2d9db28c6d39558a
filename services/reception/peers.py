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

    def _channel(self, target: str, *, balanced: bool = True) -> grpc.aio.Channel:
        channel = self._channels.get(target)
        if channel is None:
            channel = self._channels[target] = insecure_channel(target, balanced=balanced)
        return channel

    async def engine_channel(self, address: str) -> grpc.aio.Channel:
        """The channel to an engine, by the address it registered (engines come and go).

        A channel whose engine failed waits out a reconnect backoff (seconds) before it tries again;
        preparation placing a job at that address means an engine is back there (a restart), so the
        failed channel is replaced by a new one, which connects at once."""
        channel = self._channels.get(address)
        if channel is not None and channel.get_state() == grpc.ChannelConnectivity.TRANSIENT_FAILURE:
            del self._channels[address]
            await channel.close()
        return self._channel(address, balanced=False)  # one engine: nothing to balance over

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
