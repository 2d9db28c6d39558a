"""The expert index: one vector per expert in a Qdrant collection, with the facts selection needs.

Each expert that can be selected has one point: its vector is the mean of the sentence embeddings of
its description, its keywords and each of its example prompts, scaled to unit length (seed 000's
`expert.embedding`, so cosine similarity to a prompt's embedding is a dot product). The payload
holds the manifest's routing facts and the package's content hash and size. What feedback taught (the
success rate and use count) lives in Redis (`stats.py`), where every router can update it atomically;
the index attaches it to every expert it returns.

One point per expert name: the version installed last is the one selected; registering the same
version again keeps what feedback taught, a new version starts again from the prior.

Retrieval takes an expert only when the prompt's similarity reaches that expert's floor
(`calibration.py`): calibrated per expert against generic prompts by default, or one fixed floor.

Qdrant runs embedded (qdrant-client's local mode, on disk under the data directory) or as a server
(a URL); the code path is the same.

Selection's heuristic candidates (experts tagged with a task type or capability) and their
similarities come from `RoutingTags`, a snapshot of the parts of the registry that change only when
an expert is registered or removed: each expert's vector, tags and floor. Every registration and removal
writes a new revision token to a one-point collection beside the experts, and the snapshot is rebuilt
when the token differs from the one it was built at, so each router (sharing a Qdrant server or not)
sees every registration at its next plan. What feedback changes (success rate, uses) is always read
from Redis. A payload-filtered scroll would do the same work, but embedded Qdrant evaluates filters
point by point in Python: 26 ms at 1,000 experts, more than the router's whole budget.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from qdrant_client import QdrantClient, models

from libs.experts.manifest import Manifest
from services.router.calibration import DEFAULT_FLOOR, Background, FloorRule
from services.router.embedding import SentenceEncoder
from services.router.stats import ExpertStats, Stats

COLLECTION = "experts"
REVISIONS = "experts_revision"  # one point: a token that changes with every registration or removal
_NAMESPACE = uuid.UUID("5b1f0c8e-4d0a-4a53-9c1e-6f2b7f1d9a40")  # point ids: uuid5(namespace, name)
_REVISION_POINT = str(uuid.uuid5(_NAMESPACE, "revision"))
_STATS_FIELDS = ("success_rate", "uses")


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
    registered_at: float
    success_rate: float  # from the feedback statistics, not the payload
    uses: int

    @classmethod
    def from_payload(cls, payload: dict, stats: Stats) -> IndexedExpert:
        # Registries written before the statistics moved to Redis still carry them: left out.
        fields = {k: v for k, v in payload.items() if k not in _STATS_FIELDS}
        for name in ("keywords", "task_types", "capabilities", "incompatible_with"):
            fields[name] = tuple(fields[name])
        return cls(**fields, success_rate=stats.success_rate, uses=stats.uses)

    def payload(self) -> dict:
        return {
            k: list(v) if isinstance(v, tuple) else v
            for k, v in asdict(self).items()
            if k not in _STATS_FIELDS
        }


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
    """The registry's vectors, tags and similarity floors at one revision."""

    revision: str
    names: tuple[str, ...]
    vectors: torch.Tensor  # [len(names), dim], unit rows
    by_tag: dict[str, frozenset[str]]  # "task:<type>" or "capability:<name>" -> expert names
    floors: dict[str, float]  # name -> the similarity retrieval needs to take the expert

    @property
    def lowest_floor(self) -> float:
        return min(self.floors.values(), default=1.0)

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
        self,
        client: QdrantClient,
        encoder: SentenceEncoder,
        stats: ExpertStats,
        floor: FloorRule = DEFAULT_FLOOR,
        background: Background | None = None,
    ) -> None:
        self.client = client
        self.encoder = encoder
        self.stats = stats
        self.floor = floor
        self.background = background or Background(encoder)
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
            registered_at=time.time(),
            # The statistics are kept per version: the same version keeps them, a new one starts anew.
            **vars(self.stats.read([(manifest.name, manifest.version)])[0]),
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
        self.stats.forget(name)
        self._new_revision()
        return expert

    def get(self, name: str) -> IndexedExpert:
        expert = self.find(name)
        if expert is None:
            raise KeyError(name)
        return expert

    def find(self, name: str) -> IndexedExpert | None:
        found = self.experts([name])
        return found[0] if found else None

    def count(self) -> int:
        return self.client.count(COLLECTION, exact=True).count

    def list(self) -> list[IndexedExpert]:
        payloads, offset = [], None
        while True:
            points, offset = self.client.scroll(COLLECTION, limit=256, offset=offset, with_payload=True)
            payloads.extend(p.payload for p in points)
            if offset is None:
                return sorted(self._with_stats(payloads), key=lambda e: e.name)

    def _with_stats(self, payloads: list[dict]) -> list[IndexedExpert]:
        """The experts of these payloads, with their feedback statistics (one Redis round trip)."""
        stats = self.stats.read([(p["name"], p["version"]) for p in payloads])
        return [IndexedExpert.from_payload(p, s) for p, s in zip(payloads, stats, strict=True)]

    # -- selection and feedback -----------------------------------------------------------------------

    def search(
        self, vector: torch.Tensor, tags: RoutingTags, k: int = 30
    ) -> list[tuple[IndexedExpert, float]]:
        """Up to `k` experts nearest `vector`, best first, each with its cosine similarity, keeping those
        whose similarity reaches their floor in `tags` (the snapshot this selection reads)."""
        found = self.client.query_points(
            COLLECTION, query=vector.tolist(), limit=k, score_threshold=tags.lowest_floor, with_payload=True
        )
        passed = [p for p in found.points if p.score >= tags.floors.get(p.payload["name"], 1.0)]
        experts = self._with_stats([p.payload for p in passed])
        return [(e, float(p.score)) for e, p in zip(experts, passed, strict=True)]

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
        floors = dict(zip(names, self.background.floors(matrix, self.floor).tolist(), strict=True))
        return RoutingTags(revision, tuple(names), matrix, frozen, floors)

    def _new_revision(self) -> None:
        self.client.upsert(
            REVISIONS,
            points=[
                models.PointStruct(id=_REVISION_POINT, vector=[1.0], payload={"revision": uuid.uuid4().hex})
            ],
        )

    def experts(self, names: list[str]) -> list[IndexedExpert]:
        """The named experts as registered now, with fresh statistics; unknown names are left out."""
        if not names:
            return []
        points = self.client.retrieve(COLLECTION, ids=[point_id(n) for n in names], with_payload=True)
        return self._with_stats([p.payload for p in points])

    def record_outcome(self, name: str, success: bool, alpha: float) -> IndexedExpert | None:
        """Fold one job's outcome into the registered version's success rate (an exponential moving
        average with weight `alpha`) and count the use, atomically across routers; None when the
        expert is no longer registered."""
        expert = self.find(name)
        if expert is None:
            return None
        stats = self.stats.record(name, expert.version, success, alpha)
        return replace(expert, success_rate=stats.success_rate, uses=stats.uses)
