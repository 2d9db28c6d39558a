"""The engine service's speculative-decoding metrics follow the engine's counters, per drafter."""

from __future__ import annotations

import dataclasses

from prometheus_client import REGISTRY

from libs.engine.outputs import EngineStats, SpeculativeStats
from services.engine.metrics import EngineMetrics
from tests.helpers.in_process import shared_metrics


def _stats(drafted: int, accepted: int) -> EngineStats:
    return EngineStats(
        num_running=0,
        num_waiting=0,
        kv_num_blocks=8,
        kv_used_blocks=0,
        kv_free_blocks=8,
        kv_usage=0.0,
        kv_cached_blocks=0,
        kv_session_blocks=0,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
        prefix_cache_hit_rate=0.0,
        num_preemptions_total=0,
        prompt_tokens_total=0,
        generation_tokens_total=0,
        requests_finished_total={},
        num_steps_total=0,
        speculative=SpeculativeStats("ngram", drafted, accepted, 3, 0),
    )


def test_drafted_accepted_and_the_rate_are_exported_per_drafter():
    metrics = shared_metrics(EngineMetrics)  # the process's one instance (default registry)
    labels = {"drafter": "ngram"}

    def value(name: str) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    metrics.update(dataclasses.replace(_stats(0, 0), speculative=None))  # counters advance from here
    before = [
        value("expert_engine_spec_decode_draft_tokens_total"),
        value("expert_engine_spec_decode_accepted_tokens_total"),
    ]
    metrics.update(_stats(10, 4))
    metrics.update(_stats(30, 21))
    assert value("expert_engine_spec_decode_draft_tokens_total") - before[0] == 30
    assert value("expert_engine_spec_decode_accepted_tokens_total") - before[1] == 21
    assert value("expert_engine_spec_decode_acceptance_rate") == 0.7


def test_the_base_drafters_ngram_fallback_is_exported_under_ngram():
    metrics = shared_metrics(EngineMetrics)

    def value(name: str, drafter: str) -> float:
        return REGISTRY.get_sample_value(name, {"drafter": drafter}) or 0.0

    def stats(base: int, ngram: int) -> EngineStats:
        return dataclasses.replace(
            _stats(0, 0),
            speculative=SpeculativeStats("base", base, base // 2, 1, 0),
            speculative_fallback=SpeculativeStats("ngram", ngram, ngram // 4, 1, 0),
        )

    metrics.update(dataclasses.replace(_stats(0, 0), speculative=None))
    before = {d: value("expert_engine_spec_decode_draft_tokens_total", d) for d in ("base", "ngram")}
    metrics.update(stats(0, 0))
    metrics.update(stats(8, 12))
    assert value("expert_engine_spec_decode_draft_tokens_total", "base") - before["base"] == 8
    assert value("expert_engine_spec_decode_draft_tokens_total", "ngram") - before["ngram"] == 12
    assert value("expert_engine_spec_decode_acceptance_rate", "ngram") == 0.25
