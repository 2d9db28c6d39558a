"""Installing an expert into a stack: the package verified into the expert store (by content hash),
then registered with the router, which indexes it for selection. `expertctl expert install` and the
demo set's builder (`make experts`) both install through here, and find the store, the trusted keys
and the router where this module says unless told."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from libs.experts.store import StoredExpert

STORE_ENV, DEFAULT_STORE = "EXPERT_STORE", "data/experts"
TRUSTED_ENV, DEFAULT_TRUSTED = "EXPERT_TRUSTED_KEYS", "data/keys/trusted"
ROUTER_ENV, DEFAULT_ROUTER = "EXPERT_ROUTER_TARGET", "127.0.0.1:50052"
TIMEOUT = 30.0  # seconds for each call to the router's registry


def setting(given: Path | str | None, env: str, default: str) -> str:
    """`given`, else the environment variable `env` (a blank value counting as unset), else `default`."""
    return str(given) if given is not None else os.environ.get(env) or default


def register(router, entry: StoredExpert, metadata: list[tuple[str, str]]):
    """`RegisterExpert` for a package the store holds; returns the router's `RegisteredExpert`.
    Raises grpc.RpcError when the router refuses it or cannot be reached."""
    from libs.gen.expert.v1 import router_pb2

    request = router_pb2.RegisterExpertRequest(
        manifest_json=entry.manifest.to_json_bytes(),
        content_hash=entry.content_hash,
        weight_bytes=entry.weight_bytes,
    )
    return router.RegisterExpert(request, timeout=TIMEOUT, metadata=metadata).expert


def installed_line(entry: StoredExpert, created: bool) -> str:
    """What an install reports once the package is stored and registered."""
    return (
        f"{entry.name}@{entry.version} {'installed' if created else 'was already in the store'} "
        f"({entry.manifest.adapter_type}, {entry.weight_bytes} weight bytes, {entry.content_hash[:12]}…) "
        f"and registered with the router"
    )
