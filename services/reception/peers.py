"""Stubs to the other stages over channels opened once and shared by every dispatcher worker."""

from __future__ import annotations

import grpc

from libs.config import TlsConfig
from libs.gen.expert.v1 import postproc_pb2_grpc, preparation_pb2_grpc, router_pb2_grpc
from libs.grpc_client import Channels


class Peers:
    def __init__(
        self,
        router_target: str,
        preparation_target: str,
        postproc_target: str,
        internal_token: str = "",
        tls: TlsConfig | None = None,
    ) -> None:
        # Every call to a peer sends the internal token, over mutual TLS when `tls` is given.
        self._channels = Channels(internal_token, tls)
        self.router = router_pb2_grpc.RouterServiceStub(self._channels.service(router_target))
        self.preparation = preparation_pb2_grpc.PreparationServiceStub(
            self._channels.service(preparation_target)
        )
        self.postproc = postproc_pb2_grpc.PostprocServiceStub(self._channels.service(postproc_target))

    def engine_channel(self, address: str) -> grpc.aio.Channel:
        """The channel to an engine, by the address preparation placed the job at (a placement
        there means an engine is serving there, so a failed channel is replaced)."""
        return self._channels.replica(address)

    async def close(self) -> None:
        await self._channels.close()
