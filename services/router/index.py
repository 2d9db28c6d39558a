"""The expert index: one vector per expert in a Qdrant collection, with the facts selection needs.

Each expert that can be selected has one point: its vector combines the sentence embeddings of its
description, its keywords and each of its example prompts (`expert_vector`), scaled to unit length
(the expert's embedding, so cosine similarity to a prompt's embedding is a dot product). The payload
holds the manifest's routing facts and the package's content hash and size. What feedback taught (the
success rate and use count) lives in Redis (`stats.py`), where every router can update it atomically;
the index attaches it to every expert it returns.

One point per expert name: the version installed last is the one selected; registering the same
version again keeps what feedback taught, a new version starts again from the prior.

Retrieval compares the prompt whole, its request alone and sentence by sentence, adds the weight of
the prompt's words found in the expert's description and keywords, and takes an expert only when that
similarity reaches the expert's floor (`calibration.py`: calibrated per expert against generic prompts
by default, or one fixed floor), unless the topic gate finds the prompt closer to the expert's topic
probes than to the expert (`matching.py`). The gate's vectors (the probes, and each of the texts the
expert is known by) live in a second collection.

Qdrant runs embedded (qdrant-client's local mode, on disk under the data directory) or as a server
(a URL); the code path is the same.

Selection's heuristic candidates (experts tagged with a task type or capability) and their
similarities come from `RoutingTags`, a snapshot of the parts of the registry that change only when
an expert is registered or removed: each expert's vector, tags, author's words and floor. Every
registration and removal writes a new revision token to a one-point collection beside the experts,
and the snapshot is rebuilt when the token differs from the one it was built at, so each router
(sharing a Qdrant server or not) sees every registration at its next plan. What feedback changes
(success rate, uses) is always read from Redis. A payload-filtered scroll would do the same work, but
embedded Qdrant evaluates filters point by point in Python: 26 ms at 1,000 experts, more than the
router's whole budget.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
from qdrant_client import QdrantClient, models

from libs.experts.base_model import weights_fit
from libs.experts.manifest import Manifest
from services.router.calibration import DEFAULT_FLOOR, Background, FloorRule
from services.router.embedding import SentenceEncoder
from services.router.matching import (
    DEFAULT_MATCHING,
    AuthorWords,
    MatchRule,
    PromptQuery,
    WordMatch,
    author_text,
    topic_probes,
)
from services.router.stats import ExpertStats, Stats

COLLECTION = "experts"
TOPICS = "expert_topics"  # per expert with keywords: its topic probes and its texts (two multivectors)
REVISIONS = "experts_revision"  # one point: a token that changes with every registration or removal
_NAMESPACE = uuid.UUID("5b1f0c8e-4d0a-4a53-9c1e-6f2b7f1d9a40")  # point ids: uuid5(namespace, name)
_REVISION_POINT = str(uuid.uuid5(_NAMESPACE, "revision"))
_STATS_FIELDS = ("success_rate", "uses")
TOPIC_CACHE = 1024  # experts whose gate vectors a router keeps in memory (about 100 KB each)
# The author's description and keywords' share of an expert's vector, its examples' the rest. Chosen
# on the routing set (docs/experts.md#how-a-prompt-matches-an-expert): 0.3 and 0.35 did best, 0.25 to 0.45
# within one prompt of them, the plain mean (about 0.06 with 32 examples) four prompts worse.
AUTHOR_SHARE = 0.35


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
    # The base model its weights fit (manifest base_model.config_hash); "" in registries written
    # before it was kept, which fit any model until registered again.
    base_model_hash: str = ""

    def fits(self, base_model_hash: str) -> bool:
        """Whether its weights fit the model with this identity ("": any model)."""
        return weights_fit(self.base_model_hash, base_model_hash)

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


def expert_vector(texts: torch.Tensor, num_examples: int) -> torch.Tensor:
    """The expert's vector from the embeddings of `expert_text` [texts, dim], whose last
    `num_examples` rows are the examples: the author's statement
    (description and keywords) and the examples each count as a whole, `AUTHOR_SHARE` and the rest,
    however many examples there are. A plain mean over 34 texts lets 32 examples of the data drown
    what the expert does: a triage expert's customer e-mails then draw requests to write one."""
    unit = torch.nn.functional.normalize
    author = unit(texts[: len(texts) - num_examples].mean(dim=0), dim=0)
    if not num_examples:
        return author
    examples = unit(texts[len(texts) - num_examples :].mean(dim=0), dim=0)
    return unit(AUTHOR_SHARE * author + (1 - AUTHOR_SHARE) * examples, dim=0)


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
    words: AuthorWords

    @property
    def lowest_floor(self) -> float:
        return min(self.floors.values(), default=1.0)

    def tagged(self, task_types: list[str], capabilities: list[str]) -> set[str]:
        keys = [f"task:{t}" for t in task_types] + [f"capability:{c}" for c in capabilities]
        return set().union(*(self.by_tag.get(k, frozenset()) for k in keys))

    def similarity(self, query: PromptQuery, names: list[str], rule: MatchRule) -> dict[str, float]:
        """The named experts' similarity to the query as retrieval measures it (best row, plus the
        author's words), without floors or the topic gate: for candidates found another way."""
        row = {name: i for i, name in enumerate(self.names)}
        rows = [row[n] for n in names if n in row]
        if not rows:
            return {}
        best = query.best(self.vectors[rows]).values.tolist()
        hits = self.words.matches(query.text) if rule.word_weight else {}
        weights = {name: match.weight for name, match in hits.items()}
        return {
            self.names[r]: s + rule.word_weight * weights.get(self.names[r], 0.0)
            for r, s in zip(rows, best, strict=True)
        }


@dataclass(frozen=True)
class Match:
    """An expert retrieval found for a prompt, and how."""

    expert: IndexedExpert
    similarity: float  # what selection scores: `cosine`, less the row's margin, plus the author's words
    cosine: float  # the cosine of the row that reached the expert best
    row: int  # that row of the query (`PromptQuery.source` names it)
    words: WordMatch | None  # the prompt's words found in the expert's description and keywords
    word_bonus: float  # what they added to the similarity
    floor: float
    topic: Gate | None  # the topic gate's evidence (None: the expert has no probes, or no gate)

    @property
    def about_topic(self) -> bool:
        """The prompt talks about the expert's subject rather than asking for its skill."""
        return self.topic is not None and self.topic.probe >= max(self.similarity, self.topic.own_text)


@dataclass(frozen=True)
class Gate:
    """The whole prompt's cosine to an expert's nearest topic probe and to its nearest own text (its
    description, keywords or an example): the gate turns the expert away when the probe is at least as
    close as both the expert's similarity and that text."""

    probe: float
    own_text: float


@dataclass(frozen=True)
class GateVectors:
    probes: torch.Tensor  # [probes, dim]
    texts: torch.Tensor  # [texts, dim]

    @classmethod
    def of(cls, vectors: dict) -> GateVectors:
        return cls(*(torch.from_numpy(np.asarray(vectors[k], dtype=np.float32)) for k in ("probes", "texts")))

    def nearest_probe(self, vector: torch.Tensor) -> float:
        return float((self.probes @ vector).max())

    def nearest_text(self, vector: torch.Tensor) -> float:
        return float((self.texts @ vector).max())


class ExpertIndex:
    def __init__(
        self,
        client: QdrantClient,
        encoder: SentenceEncoder,
        stats: ExpertStats,
        floor: FloorRule = DEFAULT_FLOOR,
        background: Background | None = None,
        matching: MatchRule = DEFAULT_MATCHING,
    ) -> None:
        self.client = client
        self.encoder = encoder
        self.stats = stats
        self.floor = floor
        self.matching = matching
        self.background = background or Background(encoder)
        if not client.collection_exists(COLLECTION):
            client.create_collection(
                COLLECTION,
                vectors_config=models.VectorParams(size=encoder.dim, distance=models.Distance.COSINE),
            )
        if not client.collection_exists(TOPICS):
            multivector = models.VectorParams(
                size=encoder.dim,
                distance=models.Distance.COSINE,
                multivector_config=models.MultiVectorConfig(comparator=models.MultiVectorComparator.MAX_SIM),
            )
            client.create_collection(TOPICS, vectors_config={"probes": multivector, "texts": multivector})
        if not client.collection_exists(REVISIONS):
            client.create_collection(
                REVISIONS, vectors_config=models.VectorParams(size=1, distance=models.Distance.DOT)
            )
        self._tags: RoutingTags | None = None
        # (name, registered_at) -> its gate vectors (None: it has none), least recently used first.
        self._topics: OrderedDict[tuple[str, float], GateVectors | None] = OrderedDict()
        self._topics_lock = threading.Lock()

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
            base_model_hash=manifest.base_model.config_hash,
            # The statistics are kept per version: the same version keeps them, a new one starts anew.
            **vars(self.stats.read([(manifest.name, manifest.version)])[0]),
        )
        texts = self.encoder.encode(expert_text(manifest))
        vector = expert_vector(texts, len(manifest.examples))
        self.client.upsert(
            COLLECTION,
            points=[
                models.PointStruct(id=point_id(expert.name), vector=vector.tolist(), payload=expert.payload())
            ],
        )
        probes = topic_probes(manifest.keywords)
        if probes:
            vectors = {"probes": self.encoder.encode(probes).tolist(), "texts": texts.tolist()}
            self.client.upsert(TOPICS, points=[models.PointStruct(id=point_id(expert.name), vector=vectors)])
        else:  # a version without keywords replaces one with them
            self.client.delete(TOPICS, points_selector=models.PointIdsList(points=[point_id(expert.name)]))
        self._new_revision()
        return expert

    def remove(self, name: str) -> IndexedExpert:
        expert = self.get(name)
        for collection in (COLLECTION, TOPICS):
            self.client.delete(collection, points_selector=models.PointIdsList(points=[point_id(name)]))
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

    def search(self, query: PromptQuery, tags: RoutingTags, k: int = 30) -> list[Match]:
        """Up to `k` experts nearest the query, best first, that reach their floor in `tags` (the
        snapshot this selection reads), with how each matched (`matching.py`); the caller drops
        those whose match is `about_topic`."""
        weight = self.matching.word_weight
        hits = tags.words.matches(query.text) if weight else {}
        bonus = {name: weight * match.weight for name, match in hits.items()}
        found = self.client.query_batch_points(
            COLLECTION,
            requests=[
                # Lowered by the largest bonus: the author's words can lift an expert over its floor.
                models.QueryRequest(
                    query=v.tolist(),
                    limit=k,
                    score_threshold=tags.lowest_floor - max(bonus.values(), default=0.0),
                    with_payload=True,
                )
                for v in query.vectors
            ],
        )
        best: dict[str, tuple[float, float, int, dict]] = {}  # name -> less its margin, cosine, row, payload
        for row, response in enumerate(found):
            for p in response.points:
                name, reached = p.payload["name"], p.score - query.margin(row)
                if name not in best or reached > best[name][0]:
                    best[name] = (reached, float(p.score), row, p.payload)
        passed = []
        for name, (reached, cosine, row, payload) in best.items():
            similarity = reached + bonus.get(name, 0.0)
            floor = tags.floors.get(name, 1.0)
            if similarity >= floor:
                passed.append((name, similarity, cosine, row, payload, floor))
        passed.sort(key=lambda m: (-m[1], m[0]))
        passed = passed[:k]
        # A question about a subject carries no material to work on: a prompt that does is a task.
        gated = self.matching.topic_gate and not query.carries_material
        topics = self._gates(query, [m[4] for m in passed]) if gated else {}
        experts = self._with_stats([m[4] for m in passed])
        return [
            Match(
                expert, similarity, cosine, row, hits.get(name), bonus.get(name, 0.0), floor, topics.get(name)
            )
            for expert, (name, similarity, cosine, row, _, floor) in zip(experts, passed, strict=True)
        ]

    def _gates(self, query: PromptQuery, payloads: list[dict]) -> dict[str, Gate]:
        """The topic gate's evidence for each expert (experts without probes are left out). The gate
        vectors of one registration never change, so each router keeps those it used last in memory:
        reading 60 vectors per expert from Qdrant for every plan would cost more than the rest of the
        selection."""
        keys = [(p["name"], p["registered_at"]) for p in payloads]
        with self._topics_lock:
            cached = {key: self._topics[key] for key in keys if key in self._topics}
            for key in cached:
                self._topics.move_to_end(key)
        missing = [key for key in keys if key not in cached]
        if missing:
            points = self.client.retrieve(TOPICS, ids=[point_id(n) for n, _ in missing], with_vectors=True)
            stored = {str(p.id): GateVectors.of(p.vector) for p in points}
            with self._topics_lock:
                for key in missing:
                    cached[key] = self._topics[key] = stored.get(point_id(key[0]))
                    while len(self._topics) > TOPIC_CACHE:
                        self._topics.popitem(last=False)
        return {
            name: Gate(probe=gate.nearest_probe(query.whole), own_text=gate.nearest_text(query.whole))
            for (name, _), gate in ((key, cached[key]) for key in keys)
            if gate is not None
        }

    def routing_tags(self) -> RoutingTags:
        """The snapshot of vectors and tags, rebuilt when the registry's revision moved (one read of
        the revision: take it once per selection)."""
        points = self.client.retrieve(REVISIONS, ids=[_REVISION_POINT], with_payload=True)
        revision = points[0].payload["revision"] if points else ""
        if self._tags is None or self._tags.revision != revision:
            self._tags = self._build_tags(revision)
        return self._tags

    def _build_tags(self, revision: str) -> RoutingTags:
        names, vectors, by_tag, texts, offset = [], [], {}, {}, None
        while True:
            points, offset = self.client.scroll(
                COLLECTION,
                limit=256,
                offset=offset,
                with_payload=["name", "task_types", "capabilities", "description", "keywords"],
                with_vectors=True,
            )
            for p in points:
                name = p.payload["name"]
                names.append(name)
                vectors.append(p.vector)
                texts[name] = author_text(p.payload["description"], p.payload["keywords"])
                for key in [f"task:{t}" for t in p.payload["task_types"]] + [
                    f"capability:{c}" for c in p.payload["capabilities"]
                ]:
                    by_tag.setdefault(key, set()).add(name)
            if offset is None:
                break
        matrix = torch.tensor(vectors, dtype=torch.float32) if vectors else torch.empty(0, self.encoder.dim)
        frozen = {k: frozenset(v) for k, v in by_tag.items()}
        floors = dict(zip(names, self.background.floors(matrix, self.floor).tolist(), strict=True))
        words = AuthorWords(texts, self.background.stems)
        return RoutingTags(revision, tuple(names), matrix, frozen, floors, words)

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
