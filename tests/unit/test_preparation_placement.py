"""Preparation's budget rule (docs/design.md#budget-check: an overflow drops experts), its choice of
engine (the most experts hot first, then the least loaded) and its one rollback rule (a reservation
scope that gives the slot back when preparing fails)."""

from __future__ import annotations

import grpc
import pytest

from libs.errors import ServiceError
from libs.gen.expert.v1 import common_pb2
from services.preparation.budget import fit_to_budget
from services.preparation.fleet import Fleet
from services.preparation.placement import choose_engine

MODEL = common_pb2.ModelSpec(
    name="tiny", num_layers=2, num_kv_heads=2, head_dim=16, dtype_bytes=4, max_model_len=1024, block_size=16
)


def expert(name: str, score: float, forced: bool = False) -> common_pb2.PlannedExpert:
    return common_pb2.PlannedExpert(
        name=name, version="1.0.0", score=score, forced=forced, content_hash=name[0] * 64
    )


def test_the_lowest_scored_experts_are_dropped_until_the_rest_fit():
    experts = [expert("a", 0.9), expert("b", 0.5), expert("c", 0.7)]
    kept, dropped = fit_to_budget(experts, {"a": 40, "b": 40, "c": 40}, 100, "engine e1")
    assert [e.name for e in kept] == ["a", "c"]  # composition order kept
    assert [d.expert.name for d in dropped] == ["b"]
    assert dropped[0].reason.endswith("MiB engine e1 holds")


def test_a_plan_within_budget_or_without_a_reported_budget_is_kept_whole():
    experts = [expert("a", 0.9), expert("b", 0.5)]
    assert fit_to_budget(experts, {"a": 40, "b": 40}, 80, "e")[1] == []
    assert fit_to_budget(experts, {"a": 40, "b": 40}, 0, "e")[1] == []


def test_forced_experts_go_last_and_a_plan_they_alone_overflow_is_refused():
    experts = [expert("a", 0.2, forced=True), expert("b", 0.9), expert("c", 0.8)]
    kept, dropped = fit_to_budget(experts, {"a": 50, "b": 50, "c": 50}, 100, "e")
    assert [e.name for e in kept] == ["a", "b"] and [d.expert.name for d in dropped] == ["c"]
    with pytest.raises(ServiceError) as refused:
        fit_to_budget([expert("a", 0.2, True), expert("b", 0.9, True)], {"a": 60, "b": 60}, 100, "engine e1")
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "forced experts a, b" in str(refused.value)


def _fleet(*engines: tuple[str, int, list[str]]) -> Fleet:
    """Engines as (id, jobs placed, experts held)."""
    fleet = Fleet(60.0)
    for engine_id, jobs, held in engines:
        engine = fleet.register(
            common_pb2.EngineInfo(
                engine_id=engine_id,
                address=f"{engine_id}:1",
                model=MODEL,
                load=common_pb2.EngineLoad(kv_blocks_total=64, kv_blocks_free=64, max_num_seqs=4),
                experts=common_pb2.ExpertHoldings(
                    epoch=1,
                    device_budget_bytes=1000,
                    experts=[
                        common_pb2.HeldExpert(
                            name=n, version="1.0.0", content_hash=n[0] * 64, device_bytes=100
                        )
                        for n in held
                    ],
                ),
            )
        )
        for i in range(jobs):
            with fleet.reservation(f"{engine_id}-job-{i}", engine, 1):
                pass
    return fleet


PLAN = common_pb2.ExpertPlan(generation_params=common_pb2.GenerationParams(max_tokens=16), prompt_bytes=16)


def test_the_engine_holding_more_of_the_plans_experts_wins_over_a_less_loaded_one():
    fleet = _fleet(("idle", 0, []), ("busy-but-hot", 2, ["x", "y"]), ("one-hot", 0, ["x"]))
    experts = [expert("x", 0.9), expert("y", 0.8)]
    engine, _ = choose_engine(list(fleet.engines.values()), PLAN, experts, {"x": 100, "y": 100})
    assert engine.engine_id == "busy-but-hot"


def test_the_same_content_counts_as_hot_and_another_version_does_not():
    fleet = _fleet(("a", 0, []), ("b", 1, ["x"]))
    other_content = common_pb2.PlannedExpert(name="x", version="1.0.0", score=1.0, content_hash="f" * 64)
    engine, _ = choose_engine(list(fleet.engines.values()), PLAN, [other_content], {"x": 100})
    assert engine.engine_id == "a"  # b holds other content under that version: not hot, and busier


def test_without_hot_experts_the_least_loaded_engine_is_chosen():
    fleet = _fleet(("a", 3, []), ("b", 1, []))
    engine, _ = choose_engine(list(fleet.engines.values()), PLAN, [expert("x", 1.0)], {"x": 100})
    assert engine.engine_id == "b"


def test_an_engine_whose_expert_budget_is_too_small_is_passed_over():
    fleet = _fleet(("small", 0, []), ("large", 3, []))
    fleet.engines["small"].info.experts.device_budget_bytes = 150
    engine, _ = choose_engine(
        list(fleet.engines.values()), PLAN, [expert("x", 1.0), expert("y", 1.0)], {"x": 100, "y": 100}
    )
    assert engine.engine_id == "large"


def test_engines_with_no_free_slot_leave_the_job_to_wait():
    fleet = _fleet(("a", 4, []))
    with pytest.raises(ServiceError) as busy:
        choose_engine(list(fleet.engines.values()), PLAN, [], {})
    assert busy.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_a_reservation_is_kept_when_preparing_succeeds_and_only_release_gives_it_back():
    fleet = _fleet(("a", 0, ["x"]))
    engine = fleet.engines["a"]
    with fleet.reservation("job", engine, 3, ("x@1.0.0", "y@1.0.0")) as reserved:
        reserved.experts = ("x@1.0.0",)  # narrowed after staging
    assert engine.free_slots == 3 and engine.available_blocks() == 61
    assert engine.references() == {"x@1.0.0": 1}
    assert fleet.release("job") and not fleet.release("job")
    assert engine.free_slots == 4 and engine.available_blocks() == 64


@pytest.mark.parametrize("failure", [ServiceError(grpc.StatusCode.FAILED_PRECONDITION, "x"), KeyError("x")])
def test_a_reservation_is_given_back_whatever_fails_inside_it(failure):
    fleet = _fleet(("a", 1, []))
    engine = fleet.engines["a"]
    with pytest.raises(type(failure)), fleet.reservation("job", engine, 5):
        assert engine.free_slots == 2
        raise failure
    assert engine.free_slots == 3 and "job" not in fleet.jobs and engine.available_blocks() == 63


def test_reserving_again_moves_the_job_and_a_failed_move_leaves_it_nowhere():
    fleet = _fleet(("a", 0, []), ("b", 0, []))
    a, b = fleet.engines["a"], fleet.engines["b"]
    with fleet.reservation("job", a, 2):
        pass
    with fleet.reservation("job", b, 2):
        pass
    assert (a.free_slots, b.free_slots) == (4, 3)
    with pytest.raises(RuntimeError), fleet.reservation("job", a, 2):
        raise RuntimeError("staging failed")
    assert (a.free_slots, b.free_slots) == (4, 4) and not fleet.jobs


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _info(instance: str) -> common_pb2.EngineInfo:
    return common_pb2.EngineInfo(
        engine_id="e1",
        address="e1:1",
        instance_id=instance,
        model=MODEL,
        load=common_pb2.EngineLoad(kv_blocks_total=64, kv_blocks_free=64, max_num_seqs=4),
    )


def _stalled_fleet() -> tuple[Fleet, _Clock]:
    """Engine e1 (instance "a") with two jobs placed, dropped after a missed heartbeat."""
    clock = _Clock()
    fleet = Fleet(2.0, clock=clock)
    engine = fleet.register(_info("a"))
    for job_id in ("j1", "j2"):
        with fleet.reservation(job_id, engine, 4):
            pass
    clock.now = 3.0  # a long step held the engine: no heartbeat for 3 s
    assert [e.engine_id for e in fleet.expire()] == ["e1"]
    assert fleet.engines == {} and fleet.jobs == {}
    return fleet, clock


def test_an_engine_dropped_for_a_missed_heartbeat_gets_its_placements_back_when_it_registers_again():
    fleet, _ = _stalled_fleet()
    engine = fleet.register(_info("a"))
    assert sorted(engine.jobs) == ["j1", "j2"] and sorted(fleet.jobs) == ["j1", "j2"]
    assert engine.free_slots == 2  # not offered as empty while two jobs still run there
    assert fleet.release("j1") and list(engine.jobs) == ["j2"]


def test_a_restarted_engine_under_the_same_id_does_not_inherit_the_dead_processes_jobs():
    fleet, _ = _stalled_fleet()
    engine = fleet.register(_info("b"))
    assert engine.jobs == {} and fleet.jobs == {}
    # the same holds when the new process registers before the old one was even dropped
    live = Fleet(2.0)
    first = live.register(_info("a"))
    with live.reservation("j", first, 4):
        pass
    assert live.register(_info("b")).jobs == {} and live.jobs == {}
    assert live.register(_info("b")).jobs == {}


def test_a_dropped_engine_is_remembered_only_for_a_while():
    fleet, clock = _stalled_fleet()
    clock.now = 3.0 + fleet.lost_memory_s + 1
    fleet.expire()
    assert fleet.lost == {}
    assert fleet.register(_info("a")).jobs == {}
