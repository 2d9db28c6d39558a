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
from services.router.index import ExpertIndex, IndexedExpert, Match, RoutingTags
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
    """The experts for a request, in composition order, with every candidate considered and the
    trace of each step (the module's docstring lists them)."""
    limit = min(max_experts, MAX_EXPERTS)
    forced_experts = _check_forced(index, force, exclude, limit, base_model_hash)
    selection = Selection()
    task_types, capabilities = heuristic_tags(features)
    snapshot = index.routing_tags()
    pool = _Pool()
    _add_heuristic_candidates(pool, index, snapshot, task_types, capabilities)  # step 1
    about_topic = _add_retrieved_candidates(pool, index, snapshot, query)  # step 2
    pool.add_forced(force, forced_experts)
    selection.trace += pool.drop_other_base_models(base_model_hash)
    # The heuristic and forced candidates that retrieval did not reach: their similarity all the same.
    pool.similarities.update(snapshot.similarity(query, pool.without_similarity(), index.matching))
    selection.considered = _score_candidates(pool)  # step 3
    selection.trace += _considered_trace(selection.considered, about_topic, task_types, capabilities, index)
    chosen, passed_over = _choose(  # steps 4 and 5
        selection.considered, force, exclude, limit, index.matching.companion_ratio
    )
    selection.trace += passed_over
    selection.chosen = _composition_order(chosen)  # step 6
    selection.trace.append(_composition_trace(selection.chosen))
    return selection


@dataclass
class _Pool:
    """The candidates gathered so far: each expert by name, its similarity where retrieval measured
    one, and why it was considered."""

    experts: dict[str, IndexedExpert] = field(default_factory=dict)
    similarities: dict[str, float] = field(default_factory=dict)
    reasons: dict[str, list[str]] = field(default_factory=dict)

    def add(self, expert: IndexedExpert, reasons: list[str]) -> None:
        self.experts[expert.name] = expert
        self.reasons.setdefault(expert.name, []).extend(reasons)

    def add_forced(
        self, force: list[str] | tuple[str, ...], forced_experts: dict[str, IndexedExpert]
    ) -> None:
        for name in force:
            self.experts.setdefault(name, forced_experts[name])
            self.reasons.setdefault(name, []).append("forced")

    def drop_other_base_models(self, base_model_hash: str) -> list[str]:
        """Drops the experts of another base model (their weights do not fit this request's model);
        returns the trace."""
        dropped = [name for name, expert in self.experts.items() if not expert.fits(base_model_hash)]
        for name in dropped:
            del self.experts[name]
            self.similarities.pop(name, None)
        return [f"{name}: trained for another base model, not a candidate" for name in dropped]

    def without_similarity(self) -> list[str]:
        return [name for name in self.experts if name not in self.similarities]


def _check_forced(
    index: ExpertIndex,
    force: list[str] | tuple[str, ...],
    exclude: list[str] | tuple[str, ...],
    limit: int,
    base_model_hash: str,
) -> dict[str, IndexedExpert]:
    """Step 5's refusals that need no candidate, before any work: each forced expert by name, or
    every problem named by its field."""
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
    return forced_experts


def _add_heuristic_candidates(
    pool: _Pool,
    index: ExpertIndex,
    snapshot: RoutingTags,
    task_types: list[str],
    capabilities: list[str],
) -> None:
    """Step 1: the experts whose manifest lists a task type or capability the features call for."""
    for expert in index.experts(sorted(snapshot.tagged(task_types, capabilities))):
        tags = [f"task {t}" for t in task_types if t in expert.task_types]
        tags += [f"capability {c}" for c in capabilities if c in expert.capabilities]
        pool.add(expert, tags)


def _add_retrieved_candidates(
    pool: _Pool, index: ExpertIndex, snapshot: RoutingTags, query: PromptQuery
) -> list[Match]:
    """Step 2: the experts nearest the prompt that reach their floor; returns the matches not taken
    because the prompt is only about their topic."""
    about_topic = []
    for match in index.search(query, snapshot, k=RETRIEVE_K):
        if match.about_topic:
            about_topic.append(match)
            continue
        pool.add(match.expert, [_retrieval_reason(query, match)])
        pool.similarities[match.expert.name] = match.similarity
    return about_topic


def _score_candidates(pool: _Pool) -> list[Candidate]:
    """Step 3: every candidate with its score, best first."""
    considered = []
    for name, expert in pool.experts.items():
        similarity = pool.similarities.get(name, 0.0)
        considered.append(
            Candidate(
                expert,
                similarity,
                score(similarity, expert.success_rate, vram_mb(expert)),
                tuple(pool.reasons[name]),
            )
        )
    considered.sort(key=lambda c: (-c.score, c.expert.name))
    return considered


def _choose(
    considered: list[Candidate],
    force: list[str] | tuple[str, ...],
    exclude: list[str] | tuple[str, ...],
    limit: int,
    ratio: float,
) -> tuple[list[Candidate], list[str]]:
    """Steps 4 and 5: the chosen candidates, and the trace of those passed over. Forced experts come
    in the request's order (a clash names the later one), the others best first."""
    by_name = {c.expert.name: c for c in considered}
    forced = [by_name[name] for name in dict.fromkeys(force)]
    others = [c for c in considered if c.expert.name not in force]
    chosen: list[Candidate] = []
    passed_over: list[str] = []
    for candidate in forced + others:
        reason = _pass_over_reason(candidate, chosen, force, exclude, limit, ratio)
        if reason is None:
            chosen.append(candidate)
        else:
            passed_over.append(reason)
    return chosen, passed_over


def _pass_over_reason(
    candidate: Candidate,
    chosen: list[Candidate],
    force: list[str] | tuple[str, ...],
    exclude: list[str] | tuple[str, ...],
    limit: int,
    ratio: float,
) -> str | None:
    """Why `candidate` is not chosen after `chosen` (None: it is). A forced expert incompatible with
    one chosen before it is refused."""
    name = candidate.expert.name
    if name in exclude:
        return f"{name}: excluded by the request"
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
        return f"{name}: incompatible with {clash}, which was chosen first"
    if len(chosen) >= limit:
        return f"{name}: beyond max_experts {limit}"
    leader = next((c for c in chosen if c.expert.name not in force), None)
    if leader is not None and name not in force and candidate.similarity < ratio * leader.similarity:
        return (
            f"{name}: similarity {candidate.similarity:.3f} under {ratio:g} x the leader "
            f"{leader.expert.name}'s {leader.similarity:.3f}; not composed with it"
        )
    return None


def _considered_trace(
    considered: list[Candidate],
    about_topic: list[Match],
    task_types: list[str],
    capabilities: list[str],
    index: ExpertIndex,
) -> list[str]:
    """What the features asked for, the matches retrieval left to their topic, and every candidate."""
    return [
        f"features ask for task types {task_types or ['-']} and capabilities {capabilities or ['-']}; "
        f"{len(considered)} candidate(s) "
        f"(retrieval k={RETRIEVE_K}, {index.floor.describe()}, {index.matching.describe()})",
        *(_about_topic_reason(m) for m in about_topic),
        *(f"candidate {c.explain()}" for c in considered),
    ]


def _composition_trace(chosen: list[Candidate]) -> str:
    if not chosen:
        return "no suitable expert: the base model answers (fallback)"
    return "composition order (soft prompts first, then by priority): " + ", ".join(
        c.expert.name for c in chosen
    )


def _about_topic_reason(match: Match) -> str:
    return (
        f"{match.expert.name}: not taken by retrieval, the prompt is about its topic rather than a task "
        f"for it (nearest topic probe {match.topic.probe:.3f} >= similarity {match.similarity:.3f} and "
        f"nearest own text {match.topic.own_text:.3f})"
    )


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


def _composition_order(chosen: list[Candidate]) -> list[Candidate]:
    """Step 6: soft prompts first, then the other adapters, each by priority (highest first), then name."""
    return sorted(chosen, key=_composition_key)


def _composition_key(candidate: Candidate) -> tuple:
    expert = candidate.expert
    return (expert.adapter_type != "soft_prompt", -expert.priority, expert.name)
