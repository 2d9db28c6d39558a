"""Preparation's slots after an engine is dropped (services/preparation/fleet.py): a Release that
comes while the engine is dropped reaches its reservation, so the engine's registering again brings
back only the jobs still running there, and no reservation is held for ever."""

from __future__ import annotations

from libs.gen.expert.v1 import common_pb2
from services.preparation.fleet import Fleet
from tests.unit.test_preparation_placement import _info, _stalled_fleet


def test_a_job_released_while_its_engine_was_dropped_stays_released_when_it_registers_again():
    fleet, _ = _stalled_fleet()  # j1 and j2 on e1, dropped for a missed heartbeat
    assert fleet.release("j1")  # its dispatcher gave it back meanwhile
    engine = fleet.register(_info("a"))  # the same process, alive all along
    assert list(engine.jobs) == ["j2"] and list(fleet.jobs) == ["j2"]
    assert engine.free_slots == 3
    assert fleet.release("j2") and fleet.jobs == {} and engine.jobs == {}


def test_an_engine_dropped_on_a_broken_stream_and_back_holds_no_released_slot():
    fleet = Fleet(2.0)
    engine = fleet.register(_info("a"))
    for job_id in ("j1", "j2", "j3"):
        with fleet.reservation(job_id, engine, 4):
            pass
    assert fleet.drop("e1", "a") is engine  # a dispatcher's stream to it broke
    assert [fleet.release(job_id) for job_id in ("j1", "j2", "j3")] == [True, True, True]
    assert not fleet.release("j1")  # once only
    back = fleet.register(_info("a"))
    assert back.jobs == {} and fleet.jobs == {} and back.free_slots == 4


def test_a_reservation_moved_off_a_dropped_engine_is_not_brought_back_with_it():
    fleet = Fleet(2.0)
    engine = fleet.register(_info("a"))
    with fleet.reservation("j1", engine, 4):
        pass
    fleet.drop("e1", "a")
    second = common_pb2.EngineInfo()
    second.CopyFrom(_info("a"))
    second.engine_id, second.address = "e2", "e2:1"
    other = fleet.register(second)
    with fleet.reservation("j1", other, 4):  # the job placed again, on another engine
        pass
    assert fleet.register(_info("a")).jobs == {}
    assert list(fleet.jobs) == ["j1"] and fleet.jobs["j1"].engine_id == "e2"
