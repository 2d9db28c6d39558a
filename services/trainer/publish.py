"""A finished job's expert made selectable: its package verified into the expert store (the one
preparation stages from), then registered with the router, as `expertctl expert install` does."""

from __future__ import annotations

from pathlib import Path

from libs.experts.manifest import BaseModelIdentity
from libs.experts.signing import Keyring
from libs.experts.store import ExpertStore, StoredExpert
from libs.gen.expert.v1 import router_pb2, router_pb2_grpc

REGISTER_TIMEOUT_S = 60.0


def store_package(package: Path, store: Path, trusted_keys: Path, base_dir: Path) -> StoredExpert:
    """The package verified against the trusted keys and the base model, and stored; raises
    PackageError, ManifestError, SigningError or StoreError naming the problem."""
    keyring = Keyring.from_dir(trusted_keys)
    entry, _created = ExpertStore(store).install(package, keyring, BaseModelIdentity.from_dir(base_dir))
    return entry


async def register(router: router_pb2_grpc.RouterServiceStub, entry: StoredExpert) -> None:
    """Registers the stored expert with the router (which indexes it for selection); raises
    grpc.aio.AioRpcError when the router refuses it or cannot be reached."""
    request = router_pb2.RegisterExpertRequest(
        manifest_json=entry.manifest.to_json_bytes(),
        content_hash=entry.content_hash,
        weight_bytes=entry.weight_bytes,
    )
    await router.RegisterExpert(request, timeout=REGISTER_TIMEOUT_S)


def expert_record(entry: StoredExpert, served_model: str) -> dict:
    """The produced expert as a job shows it (`model`: the id a request names it by)."""
    return {
        "name": entry.name,
        "version": entry.version,
        "content_hash": entry.content_hash,
        "adapter_type": entry.manifest.adapter_type,
        "model": f"{served_model}:{entry.name}",
    }
