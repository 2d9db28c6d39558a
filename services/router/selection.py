"""Selection and score (docs/design.md#selection-and-score): which experts answer a request,
scored, filtered and ordered.

1. Heuristic candidates from the features: experts whose manifest lists the request's task type, or
   the capability its features call for (`json` for JSON in the prompt, `code` for code, and
   `language:<iso 639-1>` for a language other than English).
2. Embedding retrieval: the experts nearest the prompt's embedding, k = 30, each taken when the
   similarity reaches its floor (calibrated per expert, or one fixed floor: `calibration.py`). The
   similarity is the best over the prompt, its request alone and its sentences (a sentence's less a
   margin), plus the weight of the prompt's words found in the expert's description and keywords
   (rarer words weigh more); an expert the prompt only talks
   about (closer to one of its topic probes than to the expert and its texts) is not taken
   (`matching.py`).
3. Every candidate is scored 0.50 x similarity + 0.30 x success rate + 0.20 x (1 - vram_mb / 100),
   where vram_mb is the size of its weights in MiB (the penalty for large experts).
4. Best first, a candidate incompatible with one already chosen (either side's
   `incompatible_with`) is passed over, and so is one whose similarity is under the companion ratio
   (0.5) times the best chosen one's: floors calibrated to keep generic prompts out still let a
   prompt's weaker neighbours in, and composing an unrelated adapter spoils the answer.
5. The top K, K = `max_experts` (at most libs.limits.MAX_EXPERTS, 10). `force_experts` are chosen
   first whatever their score, `exclude_experts` never. Refused, naming the field: an unknown forced
   name, more forced experts than K, two forced experts incompatible with each other, a name both
   forced and excluded.
6. Composition order: soft prompts first, then the other adapters, each by manifest priority
   (highest first), then name.

No candidate at all means the base model answers (the fallback plan).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from libs.errors import invalid_arguments
from libs.limits import MAX_EXPERTS
from services.router.features import Features
from services.router.index import ExpertIndex, IndexedExpert, Match
from services.router.matching import PromptQuery

RETRIEVE_K = 30
W_SIMILARITY, W_SUCCESS, W_VRAM = 0.50, 0.30, 0.20
MIB = 1 << 20


def vram_mb(expert: IndexedExpert) -> float:
    return expert.weight_bytes / MIB


def score(similarity: float, success_rate: float, size_mb: float) -> float:
    """The score of a candidate (docs/design.md#selection-and-score)."""
    return W_SIMILARITY * similarity + W_SUCCESS * success_rate + W_VRAM * (1.0 - size_mb / 100.0)


@dataclass(frozen=True)
class Candidate:
    expert: IndexedExpert
    similarity: float
    score: float
    reasons: tuple[str, ...]  # why it was considered: "embedding", "task code_generation", "forced", …

    def explain(self) -> str:
        e = self.expert
        return (
            f"{e.name}@{e.version} score {self.score:.3f} = 0.50 x similarity {self.similarity:.3f} "
            f"+ 0.30 x success {e.success_rate:.3f} + 0.20 x (1 - {vram_mb(e):.2f} MB / 100) "
            f"[{', '.join(self.reasons)}]"
        )


@dataclass
class Selection:
    chosen: list[Candidate] = field(default_factory=list)  # in composition order
    considered: list[Candidate] = field(default_factory=list)  # every candidate, best first
    trace: list[str] = field(default_factory=list)

    @property
    def fallback(self) -> bool:
        return not self.chosen


def heuristic_tags(features: Features) -> tuple[list[str], list[str]]:
    """The task types and capabilities the features call for."""
    task_types = [features.task_type] if features.task_type != "general" else []
    capabilities = []
    if features.has_json:
        capabilities.append("json")
    if features.has_code:
        capabilities.append("code")
    if features.language not in ("en", "unknown"):
        capabilities.append(f"language:{features.language}")
    return task_types, capabilities


def select_experts(
    features: Features,
    query: PromptQuery,
    index: ExpertIndex,
    *,
    max_experts: int = MAX_EXPERTS,
    force: list[str] | tuple[str, ...] = (),
    exclude: list[str] | tuple[str, ...] = (),
    base_model_hash: str = "",
) -> Selection:
    selection = Selection()
    reasons: dict[str, list[str]] = {}
    experts: dict[str, IndexedExpert] = {}
    similarities: dict[str, float] = {}

    limit = min(max_experts, MAX_EXPERTS)
    forced_experts = {name: index.find(name) for name in force}
    problems = [
        (f"request.force_experts[{i}]", f"unknown expert {name!r} (not registered)")
        for i, name in enumerate(force)
        if forced_experts[name] is None
    ]
    problems += [
        (
            f"request.force_experts[{i}]",
            f"{name!r} was trained for another base model than the one this request runs on",
        )
        for i, name in enumerate(force)
        if forced_experts[name] is not None and not forced_experts[name].fits(base_model_hash)
    ]
    problems += [
        (f"request.exclude_experts[{i}]", f"{name!r} is also forced")
        for i, name in enumerate(exclude)
        if name in force
    ]
    if len(set(force)) > limit:
        problems.append(
            ("request.force_experts", f"{len(set(force))} experts forced, more than max_experts {limit}")
        )
    if problems:
        raise invalid_arguments(problems)

    task_types, capabilities = heuristic_tags(features)
    snapshot = index.routing_tags()
    for expert in index.experts(sorted(snapshot.tagged(task_types, capabilities))):
        experts[expert.name] = expert
        tags = [f"task {t}" for t in task_types if t in expert.task_types]
        tags += [f"capability {c}" for c in capabilities if c in expert.capabilities]
        reasons.setdefault(expert.name, []).extend(tags)
    about_topic = []
    for match in index.search(query, snapshot, k=RETRIEVE_K):
        name = match.expert.name
        if match.about_topic:
            about_topic.append(match)
            continue
        experts[name] = match.expert
        similarities[name] = match.similarity
        reasons.setdefault(name, []).append(_retrieval_reason(query, match))
    for name in force:
        experts.setdefault(name, forced_experts[name])
        reasons.setdefault(name, []).append("forced")
    # Experts of another base model: their weights do not fit this request's model.
    for name in [name for name, expert in experts.items() if not expert.fits(base_model_hash)]:
        del experts[name]
        similarities.pop(name, None)
        selection.trace.append(f"{name}: trained for another base model, not a candidate")
    unknown_similarity = [name for name in experts if name not in similarities]
    similarities.update(snapshot.similarity(query, unknown_similarity, index.matching))

    for name, expert in experts.items():
        similarity = similarities.get(name, 0.0)
        candidate = Candidate(
            expert, similarity, score(similarity, expert.success_rate, vram_mb(expert)), tuple(reasons[name])
        )
        selection.considered.append(candidate)
    selection.considered.sort(key=lambda c: (-c.score, c.expert.name))
    selection.trace.append(
        f"features ask for task types {task_types or ['-']} and capabilities {capabilities or ['-']}; "
        f"{len(selection.considered)} candidate(s) "
        f"(retrieval k={RETRIEVE_K}, {index.floor.describe()}, {index.matching.describe()})"
    )
    selection.trace.extend(
        f"{m.expert.name}: not taken by retrieval, the prompt is about its topic rather than a task for "
        f"it (nearest topic probe {m.topic.probe:.3f} >= similarity {m.similarity:.3f} and nearest "
        f"own text {m.topic.own_text:.3f})"
        for m in about_topic
    )
    selection.trace.extend(f"candidate {c.explain()}" for c in selection.considered)

    # Forced experts in the request's order (a clash names the later one), the others best first.
    by_name = {c.expert.name: c for c in selection.considered}
    forced = [by_name[name] for name in dict.fromkeys(force)]
    others = [c for c in selection.considered if c.expert.name not in force]
    chosen: list[Candidate] = []
    ratio = index.matching.companion_ratio
    for candidate in forced + others:
        name = candidate.expert.name
        if name in exclude:
            selection.trace.append(f"{name}: excluded by the request")
            continue
        clash = next((c.expert.name for c in chosen if _incompatible(c.expert, candidate.expert)), None)
        if clash is not None and name in force:
            raise invalid_arguments(
                [
                    (
                        f"request.force_experts[{list(force).index(name)}]",
                        f"{name!r} is incompatible with {clash!r}",
                    )
                ]
            )
        if clash is not None:
            selection.trace.append(f"{name}: incompatible with {clash}, which was chosen first")
            continue
        if len(chosen) >= limit:
            selection.trace.append(f"{name}: beyond max_experts {limit}")
            continue
        leader = next((c for c in chosen if c.expert.name not in force), None)
        if leader is not None and name not in force and candidate.similarity < ratio * leader.similarity:
            selection.trace.append(
                f"{name}: similarity {candidate.similarity:.3f} under {ratio:g} x the leader "
                f"{leader.expert.name}'s {leader.similarity:.3f}; not composed with it"
            )
            continue
        chosen.append(candidate)
    selection.chosen = sorted(chosen, key=_composition_key)
    if selection.chosen:
        selection.trace.append(
            "composition order (soft prompts first, then by priority): "
            + ", ".join(c.expert.name for c in selection.chosen)
        )
    else:
        selection.trace.append("no suitable expert: the base model answers (fallback)")
    return selection


def _retrieval_reason(query: PromptQuery, match: Match) -> str:
    """E.g. "embedding 0.412 (sentence 2) - 0.08 + words sql, queri 0.083, floor 0.262, topic probe
    0.180"."""
    margin = query.margin(match.row)
    parts = [f"embedding {match.cosine:.3f} ({query.source(match.row)})"]
    if margin:
        parts.append(f" - {margin:g}")
    if match.words is not None and match.word_bonus:
        parts.append(f" + words {', '.join(match.words.words)} {match.word_bonus:.3f}")
    parts.append(f", floor {match.floor:.3f}")
    if match.topic is not None:
        parts.append(f", topic probe {match.topic.probe:.3f}, own text {match.topic.own_text:.3f}")
    return "".join(parts)


def _incompatible(a: IndexedExpert, b: IndexedExpert) -> bool:
    return b.name in a.incompatible_with or a.name in b.incompatible_with


def _composition_key(candidate: Candidate) -> tuple:
    expert = candidate.expert
    return (expert.adapter_type != "soft_prompt", -expert.priority, expert.name)
