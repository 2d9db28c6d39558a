"""The RouterService's registry calls: the experts the router can select, kept in its index."""

from __future__ import annotations

import re

from libs.errors import invalid_argument, invalid_arguments, not_found
from libs.experts.errors import ManifestError
from libs.experts.manifest import Manifest
from libs.gen.expert.v1 import router_pb2
from libs.timestamps import timestamp
from services.router.index import ExpertIndex, IndexedExpert

_HASH = re.compile(r"[0-9a-f]{64}")


def registered(expert: IndexedExpert) -> router_pb2.RegisteredExpert:
    return router_pb2.RegisteredExpert(
        name=expert.name,
        version=expert.version,
        adapter_type=expert.adapter_type,
        description=expert.description,
        keywords=expert.keywords,
        task_types=expert.task_types,
        capabilities=expert.capabilities,
        incompatible_with=expert.incompatible_with,
        priority=expert.priority,
        content_hash=expert.content_hash,
        weight_bytes=expert.weight_bytes,
        success_rate=expert.success_rate,
        uses=expert.uses,
        registered_at=timestamp(expert.registered_at),
        base_model_hash=expert.base_model_hash,
    )


class Registry:
    def __init__(self, index: ExpertIndex) -> None:
        self.index = index

    def register(self, request: router_pb2.RegisterExpertRequest) -> router_pb2.RegisterExpertResponse:
        problems = []
        if not _HASH.fullmatch(request.content_hash):
            problems.append(("content_hash", "must be the package's sha256, 64 lowercase hex digits"))
        if request.weight_bytes <= 0:
            problems.append(("weight_bytes", f"must be positive, got {request.weight_bytes}"))
        try:
            manifest = Manifest.from_json_bytes(request.manifest_json)
        except ManifestError as exc:
            # manifest.rank -> manifest_json.rank: the request's field, then the manifest's
            problems.append(("manifest_json" + exc.field.removeprefix("manifest"), exc.problem))
            manifest = None
        if problems:
            raise invalid_arguments(problems)
        previous = self.index.find(manifest.name)
        expert = self.index.register(manifest, request.content_hash, request.weight_bytes)
        created = previous is None or previous.version != expert.version
        return router_pb2.RegisterExpertResponse(expert=registered(expert), created=created)

    def get(self, name: str) -> router_pb2.RegisteredExpert:
        if not name:
            raise invalid_argument("name", "must not be empty")
        expert = self.index.find(name)
        if expert is None:
            raise not_found(f"expert {name!r} is not registered")
        return registered(expert)

    def list(self) -> list[router_pb2.RegisteredExpert]:
        return [registered(e) for e in self.index.list()]

    def unregister(self, name: str) -> router_pb2.RegisteredExpert:
        expert = self.get(name)
        self.index.remove(name)
        return expert
