"""Several base models in one fleet: preparation lists each model once (the first registered is the
default), places a job only on engines of its model and fails one no engine serves at once;
reception resolves a request's model from the capacity answer."""

from __future__ import annotations

import grpc
import pytest

from libs.engine.config import EngineConfig
from libs.errors import ServiceError
from libs.gen.expert.v1 import common_pb2, preparation_pb2
from services.preparation.fleet import Fleet
from services.preparation.placement import eligible
from services.reception.capacity import served_model


def spec(name: str, max_model_len: int, temperature: float) -> common_pb2.ModelSpec:
    return common_pb2.ModelSpec(
        name=name,
        base_model_hash=name[0] * 64,
        num_layers=2,
        num_kv_heads=2,
        head_dim=16,
        dtype_bytes=4,
        max_model_len=max_model_len,
        block_size=16,
        sampling_defaults=common_pb2.SamplingDefaults(temperature=temperature),
    )


@pytest.fixture
def fleet() -> Fleet:
    clock = iter(range(100))
    fleet = Fleet(60.0, clock=lambda: float(next(clock)))
    for engine_id, model in [
        ("a1", spec("alpha", 2048, 0.2)),
        ("b1", spec("beta", 512, 0.7)),
        ("a2", spec("alpha", 1024, 0.9)),
    ]:
        fleet.register(
            common_pb2.EngineInfo(
                engine_id=engine_id,
                address=f"{engine_id}:1",
                model=model,
                load=common_pb2.EngineLoad(kv_blocks_total=64, kv_blocks_free=64, max_num_seqs=4),
            )
        )
    return fleet


def test_each_model_is_listed_once_in_registration_order_with_its_pools_facts(fleet):
    alpha, beta = fleet.models()
    assert (alpha.name, alpha.engines, alpha.free_slots, alpha.max_model_len) == ("alpha", 2, 8, 1024)
    assert alpha.sampling_defaults.temperature == pytest.approx(0.2)  # its first engine's
    assert alpha.base_model_hash == "a" * 64
    assert (beta.name, beta.engines, beta.max_model_len) == ("beta", 1, 512)


def test_a_job_goes_only_to_engines_of_its_model_and_one_no_engine_serves_fails(fleet):
    assert sorted(e.engine_id for e in eligible(fleet, set(), "alpha")) == ["a1", "a2"]
    assert [e.engine_id for e in eligible(fleet, {"a1"}, "alpha")] == ["a2"]
    assert len(eligible(fleet, set(), "")) == 3  # no model asked: any engine
    with pytest.raises(ServiceError) as refused:
        eligible(fleet, set(), "gamma")
    assert refused.value.code is grpc.StatusCode.FAILED_PRECONDITION
    assert "'gamma' (served: alpha, beta)" in refused.value.message
    with pytest.raises(ServiceError) as waiting:  # no engine at all: the job waits for one
        eligible(Fleet(60.0), set(), "alpha")
    assert waiting.value.code is grpc.StatusCode.UNAVAILABLE


def test_reception_resolves_the_named_model_or_the_default_and_refuses_an_unserved_one(fleet):
    capacity = preparation_pb2.GetCapacityResponse(models=fleet.models())
    assert served_model(capacity, common_pb2.InferenceRequest(prompt="x")).name == "alpha"
    assert served_model(capacity, common_pb2.InferenceRequest(prompt="x", model="beta")).name == "beta"
    with pytest.raises(ServiceError) as refused:
        served_model(capacity, common_pb2.InferenceRequest(prompt="x", model="gamma"))
    assert refused.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.violations[0][0] == "request.model"
    # Before any engine registered, nothing is known: the job is taken and waits for an engine.
    empty = preparation_pb2.GetCapacityResponse()
    assert served_model(empty, common_pb2.InferenceRequest(prompt="x", model="gamma")) is None


def test_an_engine_is_served_under_its_directory_name_unless_named_and_names_have_no_colon():
    assert EngineConfig(model="/models/SmolLM2-135M-Instruct/").model_name == "SmolLM2-135M-Instruct"
    assert EngineConfig(model="/m/x", served_model_name="smol").model_name == "smol"
    with pytest.raises(ValueError, match="served_model_name"):
        EngineConfig(model="/m/x", served_model_name="smol:json")
