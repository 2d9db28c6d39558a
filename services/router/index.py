"""The expert index: one vector per expert in a Qdrant collection, with the facts selection needs.

Each expert that can be selected has one point: its vector is the mean of the sentence embeddings of
its description, its keywords and each of its example prompts, scaled to unit length (seed 000's
`expert.embedding`, so cosine similarity to a prompt's embedding is a dot product). The payload
holds the manifest's routing facts, the package's content hash and size, and what feedback taught:
the success rate (an exponential moving average starting from a prior) and the use count.

One point per expert name: the version installed last is the one selected; registering the same
version again keeps what feedback taught, a new version starts again from the prior.

Qdrant runs embedded (qdrant-client's local mode, on disk under the data directory) or as a server
(a URL); the code path is the same.

Selection's heuristic candidates (experts tagged with a task type or capability) and their
similarities come from `RoutingTags`, a snapshot of the parts of the registry that change only when
an expert is registered or removed: each expert's vector and tags. Every registration and removal
writes a new revision token to a one-point collection beside the experts, and the snapshot is rebuilt
when the token differs from the one it was built at, so each router (sharing a Qdrant server or not)
sees every registration at its next plan. What feedback changes (success rate, uses) is always read
from Qdrant. A payload-filtered scroll would do the same work, but embedded Qdrant evaluates filters
point by point in Python: 26 ms at 1,000 experts, more than the router's whole budget.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from qdrant_client import QdrantClient, models

from libs.experts.manifest import Manifest
from services.router.embedding import SentenceEncoder

COLLECTION = "experts"
REVISIONS = "experts_revision"  # one point: a token that changes with every registration or removal
_NAMESPACE = uuid.UUID("5b1f0c8e-4d0a-4a53-9c1e-6f2b7f1d9a40")  # point ids: uuid5(namespace, name)
_REVISION_POINT = str(uuid.uuid5(_NAMESPACE, "revision"))


@dataclass(frozen=True)
class IndexedExpert:
    """What the router knows of a selectable expert."""

    name: str
    version: str
    adapter_type: str
    description: str
    keywords: tuple[str, ...]
    task_types: tuple[str, ...]
    capabilities: tuple[str, ...]
    incompatible_with: tuple[str, ...]
    priority: int
    content_hash: str
    weight_bytes: int
    success_rate: float
    uses: int
    registered_at: float

    @classmethod
    def from_payload(cls, payload: dict) -> IndexedExpert:
        fields = dict(payload)
        for name in ("keywords", "task_types", "capabilities", "incompatible_with"):
            fields[name] = tuple(fields[name])
        return cls(**fields)

    def payload(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


def expert_text(manifest: Manifest) -> list[str]:
    """The texts an expert is known by: its description, its keywords, each example prompt."""
    texts = [manifest.description]
    if manifest.keywords:
        texts.append(", ".join(manifest.keywords))
    texts.extend(manifest.examples)
    return texts


def point_id(name: str) -> str:
    return str(uuid.uuid5(_NAMESPACE, name))


@dataclass(frozen=True)
class RoutingTags:
    """The registry's vectors and tags at one revision."""

    revision: str
    names: tuple[str, ...]
    vectors: torch.Tensor  # [len(names), dim], unit rows
    by_tag: dict[str, frozenset[str]]  # "task:<type>" or "capability:<name>" -> expert names

    def tagged(self, task_types: list[str], capabilities: list[str]) -> set[str]:
        keys = [f"task:{t}" for t in task_types] + [f"capability:{c}" for c in capabilities]
        return set().union(*(self.by_tag.get(k, frozenset()) for k in keys))

    def similarity(self, vector: torch.Tensor, names: list[str]) -> dict[str, float]:
        row = {name: i for i, name in enumerate(self.names)}
        rows = [row[n] for n in names if n in row]
        scores = (self.vectors[rows] @ vector).tolist() if rows else []
        return {self.names[r]: s for r, s in zip(rows, scores, strict=True)}


class ExpertIndex:
    def __init__(
        self, client: QdrantClient, encoder: SentenceEncoder, prior_success_rate: float = 0.5
    ) -> None:
        if not 0.0 <= prior_success_rate <= 1.0:
            raise ValueError(f"prior_success_rate must be in [0, 1], got {prior_success_rate}")
        self.client = client
        self.encoder = encoder
        self.prior_success_rate = prior_success_rate
        if not client.collection_exists(COLLECTION):
            client.create_collection(
                COLLECTION,
                vectors_config=models.VectorParams(size=encoder.dim, distance=models.Distance.COSINE),
            )
        if not client.collection_exists(REVISIONS):
            client.create_collection(
                REVISIONS, vectors_config=models.VectorParams(size=1, distance=models.Distance.DOT)
            )
        self._tags: RoutingTags | None = None

    @staticmethod
    def connect(data_dir: str | Path | None = None, url: str | None = None) -> QdrantClient:
        """A Qdrant server at `url`, else embedded Qdrant stored under `data_dir`/qdrant."""
        if url:
            return QdrantClient(url=url)
        if data_dir is None:
            raise ValueError("give the data directory for embedded Qdrant, or a Qdrant server URL")
        path = Path(data_dir) / "qdrant"
        path.mkdir(parents=True, exist_ok=True)
        return QdrantClient(path=str(path))

    # -- the registry ---------------------------------------------------------------------------------

    def register(self, manifest: Manifest, content_hash: str, weight_bytes: int) -> IndexedExpert:
        """Make this version of the expert the selectable one (see the module's notes on stats)."""
        previous = self.find(manifest.name)
        same_version = previous is not None and previous.version == manifest.version
        expert = IndexedExpert(
            name=manifest.name,
            version=manifest.version,
            adapter_type=manifest.adapter_type,
            description=manifest.description,
            keywords=tuple(manifest.keywords),
            task_types=tuple(manifest.task_types),
            capabilities=tuple(manifest.capabilities),
            incompatible_with=tuple(manifest.incompatible_with),
            priority=manifest.priority,
            content_hash=content_hash,
            weight_bytes=weight_bytes,
            success_rate=previous.success_rate if same_version else self.prior_success_rate,
            uses=previous.uses if same_version else 0,
            registered_at=time.time(),
        )
        vector = self.embed_expert(manifest)
        self.client.upsert(
            COLLECTION,
            points=[
                models.PointStruct(id=point_id(expert.name), vector=vector.tolist(), payload=expert.payload())
            ],
        )
        self._new_revision()
        return expert

    def embed_expert(self, manifest: Manifest) -> torch.Tensor:
        vectors = self.encoder.encode(expert_text(manifest))
        return torch.nn.functional.normalize(vectors.mean(dim=0), dim=0)

    def remove(self, name: str) -> IndexedExpert:
        expert = self.get(name)
        self.client.delete(COLLECTION, points_selector=models.PointIdsList(points=[point_id(name)]))
        self._new_revision()
        return expert

    def get(self, name: str) -> IndexedExpert:
        expert = self.find(name)
        if expert is None:
            raise KeyError(name)
        return expert

    def find(self, name: str) -> IndexedExpert | None:
        points = self.client.retrieve(COLLECTION, ids=[point_id(name)], with_payload=True)
        return IndexedExpert.from_payload(points[0].payload) if points else None

    def count(self) -> int:
        return self.client.count(COLLECTION, exact=True).count

    def list(self) -> list[IndexedExpert]:
        return sorted(self._scroll(None), key=lambda e: e.name)

    def _scroll(self, where: models.Filter | None) -> list[IndexedExpert]:
        experts, offset = [], None
        while True:
            points, offset = self.client.scroll(
                COLLECTION, scroll_filter=where, limit=256, offset=offset, with_payload=True
            )
            experts.extend(IndexedExpert.from_payload(p.payload) for p in points)
            if offset is None:
                return experts

    # -- selection and feedback -----------------------------------------------------------------------

    def search(
        self, vector: torch.Tensor, k: int = 30, threshold: float = 0.6
    ) -> list[tuple[IndexedExpert, float]]:
        """Up to `k` experts whose cosine similarity to `vector` is at least `threshold`, best first."""
        found = self.client.query_points(
            COLLECTION, query=vector.tolist(), limit=k, score_threshold=threshold, with_payload=True
        )
        return [(IndexedExpert.from_payload(p.payload), float(p.score)) for p in found.points]

    def routing_tags(self) -> RoutingTags:
        """The snapshot of vectors and tags, rebuilt when the registry's revision moved (one read of
        the revision: take it once per selection)."""
        points = self.client.retrieve(REVISIONS, ids=[_REVISION_POINT], with_payload=True)
        revision = points[0].payload["revision"] if points else ""
        if self._tags is None or self._tags.revision != revision:
            self._tags = self._build_tags(revision)
        return self._tags

    def _build_tags(self, revision: str) -> RoutingTags:
        names, vectors, by_tag, offset = [], [], {}, None
        while True:
            points, offset = self.client.scroll(
                COLLECTION,
                limit=256,
                offset=offset,
                with_payload=["name", "task_types", "capabilities"],
                with_vectors=True,
            )
            for p in points:
                name = p.payload["name"]
                names.append(name)
                vectors.append(p.vector)
                for key in [f"task:{t}" for t in p.payload["task_types"]] + [
                    f"capability:{c}" for c in p.payload["capabilities"]
                ]:
                    by_tag.setdefault(key, set()).add(name)
            if offset is None:
                break
        matrix = torch.tensor(vectors, dtype=torch.float32) if vectors else torch.empty(0, self.encoder.dim)
        frozen = {k: frozenset(v) for k, v in by_tag.items()}
        return RoutingTags(revision, tuple(names), matrix, frozen)

    def _new_revision(self) -> None:
        self.client.upsert(
            REVISIONS,
            points=[
                models.PointStruct(id=_REVISION_POINT, vector=[1.0], payload={"revision": uuid.uuid4().hex})
            ],
        )

    def experts(self, names: list[str]) -> list[IndexedExpert]:
        """The named experts as registered now (fresh success rates and uses); unknown names are
        left out."""
        if not names:
            return []
        points = self.client.retrieve(COLLECTION, ids=[point_id(n) for n in names], with_payload=True)
        return [IndexedExpert.from_payload(p.payload) for p in points]

    def record_outcome(self, name: str, success: bool, alpha: float) -> IndexedExpert | None:
        """Fold one job's outcome into the expert's success rate (an exponential moving average with
        weight `alpha`) and count the use; None when the expert is no longer registered. A read and
        a write: the feedback consumer that calls it must be the only writer of an expert's stats."""
        expert = self.find(name)
        if expert is None:
            return None
        rate = expert.success_rate + alpha * ((1.0 if success else 0.0) - expert.success_rate)
        self.client.set_payload(
            COLLECTION, payload={"success_rate": rate, "uses": expert.uses + 1}, points=[point_id(name)]
        )
        return IndexedExpert.from_payload({**expert.payload(), "success_rate": rate, "uses": expert.uses + 1})
