"""Training jobs through the whole system (docs/api.md#training-jobs): a stack on the tiny model with
EXPERT_AUTH=required and the trainer worker as a real process (the shared `trainer_stack`, with keys
of this module's own). A job is submitted over REST or gRPC,
reports progress events, checkpoints, and ends with its expert installed and registered, selected
by the router for a prompt of its task with no manual step; a cancel stops it within a step; a
trainer killed mid-training is restarted and the job goes on from its last checkpoint to the same
loss; two jobs queued behind one trainer run one after the other; bounds and scopes are refused.

The training files are written with libs.training.files (the store the `/v1/files` route writes),
under the train key's id, the owner a job reads its data as.
"""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import httpx
import pytest
import redis.asyncio

from expert_system import ExpertClient
from libs.auth.metadata import credentials_metadata
from libs.gen.expert.v1 import (
    keys_pb2,
    router_pb2,
    router_pb2_grpc,
    training_pb2,
    training_pb2_grpc,
)
from libs.training.files import TrainingFiles
from tests.e2e.conftest import TRAINING_TOKEN, TrainerStack

INTERNAL = credentials_metadata(internal_token=TRAINING_TOKEN)
WORDS = ("apple", "river", "stone", "cloud", "tiger", "lemon", "piano", "candle", "garden", "rocket")
DEADLINE_S = 300.0
# One recipe for the reference run and the interrupted one: 27 samples to train on (3 held out), 2 a
# step, 3 epochs.
RECIPE = {
    "adapter": {"type": "lora", "rank": 4},
    "hyperparameters": {"epochs": 3, "batch_size": 2, "learning_rate": 0.01, "patience": 3, "seed": 7},
    "checkpoint_every_steps": 3,
}
SAMPLES, STEPS = 30, 42


class Training:
    """The stack, its keys, and the calls the tests make."""

    def __init__(self, shared: TrainerStack) -> None:
        self.stack, self.store, self.checkpoints = shared.stack, shared.store, shared.checkpoints
        self.train_id, train_key = shared.create_key("trainer", keys_pb2.KEY_SCOPE_TRAIN)
        _, infer_key = shared.create_key("reader", keys_pb2.KEY_SCOPE_INFER)
        self.train_headers = {"authorization": f"Bearer {train_key}"}
        self.infer_headers = {"authorization": f"Bearer {infer_key}"}
        self.train_key = train_key
        self.http = httpx.Client(base_url=self.stack.http_url(), timeout=30)
        self.reference: dict | None = None  # the uninterrupted run of RECIPE

    def upload(self, records: list[dict]) -> str:
        content = "".join(json.dumps(r) + "\n" for r in records).encode()

        async def put() -> str:
            client = redis.asyncio.Redis.from_url(self.stack.redis_url)
            try:
                return (
                    await TrainingFiles(client).put(self.train_id, "data.jsonl", "fine-tune", content)
                ).file_id
            finally:
                await client.aclose()

        return asyncio.run(put())

    def submit(self, spec: dict, headers: dict | None = None) -> httpx.Response:
        return self.http.post("/v1/training/jobs", json=spec, headers=headers or self.train_headers)

    def job(self, job_id: str) -> dict:
        response = self.http.get(f"/v1/training/jobs/{job_id}", headers=self.train_headers)
        assert response.status_code == 200, response.text
        return response.json()

    def wait(self, job_id: str, done, what: str) -> dict:
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:
            job = self.job(job_id)
            if done(job):
                return job
            assert job["status"] not in ("FAILED",) or done(job), job["error"]
            time.sleep(0.05)
        pytest.fail(f"job {job_id} never {what}: {self.job(job_id)}; logs in {self.stack.log_dir}")

    def wait_final(self, job_id: str) -> dict:
        return self.wait(job_id, lambda j: j["status"] in ("COMPLETED", "FAILED", "CANCELLED"), "ended")

    def events(self, job_id: str) -> list[dict]:
        response = self.http.get(f"/v1/training/jobs/{job_id}/events?limit=1000", headers=self.train_headers)
        assert response.status_code == 200, response.text
        return response.json()["data"]


def shout_samples(count: int = SAMPLES) -> list[dict]:
    """A learnable task: the answer is the prompt's word in capitals."""
    return [
        {
            "prompt": f"Shout the word {WORDS[i % len(WORDS)]} {i}",
            "completion": f"{WORDS[i % len(WORDS)].upper()}!",
        }
        for i in range(count)
    ]


def spec(file_id: str, name: str, **changes) -> dict:
    expert = {
        "name": name,
        "description": "Shouts the word it is given back in capital letters.",
        "keywords": ["shout", "capitals", "word"],
    }
    return {"training_file": file_id, "expert": expert, **json.loads(json.dumps(RECIPE)), **changes}


@pytest.fixture(scope="module")
def training(trainer_stack: TrainerStack) -> Training:
    trainer_stack.trainer_running()
    training = Training(trainer_stack)
    yield training
    trainer_stack.end_jobs(training.train_key)
    training.http.close()


def test_a_job_reports_progress_and_ends_with_an_expert_the_router_selects(training):
    file_id = training.upload(shout_samples())
    created = training.submit(spec(file_id, "shouter"))
    assert created.status_code == 201, created.text
    job = created.json()
    assert job["status"] == "PENDING" and job["spec"]["hyperparameters"]["epochs"] == 3

    done = training.wait_final(job["id"])
    assert done["status"] == "COMPLETED", done["error"]
    training.reference = done
    assert done["expert"]["name"] == "shouter" and done["expert"]["model"].endswith(":shouter")
    assert done["metrics"]["step"] == STEPS
    events = training.events(job["id"])
    progress = [e["data"] for e in events if e["type"] == "progress"]
    assert [p["step"] for p in progress] == list(range(1, STEPS + 1))
    assert all(p["tokens_per_second"] > 0 and p["eta_seconds"] is not None for p in progress)
    assert progress[0]["train_loss"] > progress[-1]["train_loss"]
    assert [e["data"]["eval_loss"] is not None for e in events if e["type"] == "epoch"] == [True] * 3
    statuses = [e["data"]["status"] for e in events if e["type"] == "status" and "status" in e["data"]]
    assert statuses[0] == "PENDING" and "RUNNING" in statuses and statuses[-1] == "COMPLETED"
    listed = training.http.get(f"/v1/training/jobs/{job['id']}/checkpoints", headers=training.train_headers)
    assert [c["step"] for c in listed.json()["data"]] == list(range(3, STEPS + 1, 3))

    # Installed and registered with no manual step: the router knows it, and routes its task to it.
    with training.stack.channel(training.stack.target("router")) as channel:  # mutual TLS
        registered = router_pb2_grpc.RouterServiceStub(channel).ListRegisteredExperts(
            router_pb2.ListRegisteredExpertsRequest(), metadata=INTERNAL, timeout=10
        )
    assert "shouter" in [e.name for e in registered.experts]
    with ExpertClient(training.stack.target("reception"), api_key=training.train_key) as client:
        result = client.infer(prompt="Shout the word tiger 99", temperature=0.0, max_tokens=4)
    assert result.status == "completed", result.error
    assert "shouter" in result.experts_used


def test_a_trainer_killed_mid_training_resumes_from_its_last_checkpoint(training):
    if training.reference is None:
        pytest.skip("needs the reference run of the first test")
    file_id = training.upload(shout_samples())
    # Checkpoints are taken between steps and change nothing of the run; the first one, at step 2,
    # leaves 40 steps to kill the trainer in.
    job = training.submit(spec(file_id, "shouter-again", checkpoint_every_steps=2)).json()
    training.wait(job["id"], lambda j: len(j["checkpoints"]) >= 1, "checkpointed")
    training.stack.kill("trainer")
    killed = training.job(job["id"])
    assert killed["status"] in ("RUNNING", "CHECKPOINTING"), killed

    training.stack.start_service("trainer")
    done = training.wait_final(job["id"])
    assert done["status"] == "COMPLETED", done["error"]
    resumed = [e for e in training.events(job["id"]) if e["message"].startswith("resuming from checkpoint")]
    assert resumed, "the restarted trainer did not resume from a checkpoint"
    reference = training.reference["metrics"]
    assert done["metrics"]["eval_loss"] == pytest.approx(reference["eval_loss"], rel=0.05)
    assert done["metrics"]["train_loss"] == pytest.approx(reference["train_loss"], rel=0.05)


def test_a_checkpoint_on_request_then_cancel_within_a_step_then_resume_from_it(training):
    # 5,400 steps of one sample (at most EXPERT_TRAINING_MAX_EPOCHS, 50, epochs of 108).
    file_id = training.upload(shout_samples(120))
    long_run = spec(file_id, "never-finished", hyperparameters={"epochs": 50, "batch_size": 1})
    long_run["checkpoint_every_steps"] = 1000
    job = training.submit(long_run).json()
    path = f"/v1/training/jobs/{job['id']}"
    training.wait(job["id"], lambda j: j["status"] == "RUNNING" and j["metrics"].get("step", 0) >= 1, "ran")
    asked = training.http.post(path + "/checkpoint", headers=training.train_headers)
    assert asked.status_code == 202, asked.text
    checkpoint_id = asked.json()["checkpoint_id"]
    training.wait(job["id"], lambda j: [c["id"] for c in j["checkpoints"]] == [checkpoint_id], "checkpointed")

    cancelling = training.http.delete(path, headers=training.train_headers)
    assert cancelling.status_code == 200, cancelling.text
    step_then = cancelling.json()["metrics"]["step"]
    done = training.wait_final(job["id"])
    assert done["status"] == "CANCELLED"
    assert done["metrics"]["step"] <= step_then + 1  # the step under way when the cancel came, at most
    assert (training.checkpoints / job["id"] / checkpoint_id / "trainer_state.pt").is_file()
    refused = training.http.post(path + "/checkpoint", headers=training.train_headers)
    assert refused.status_code == 400 and "CANCELLED" in refused.json()["error"]["message"]

    resumed = training.http.post(
        path + "/resume", json={"checkpoint_id": checkpoint_id}, headers=training.train_headers
    )
    # Queued again: the idle trainer may have taken it before the answer was read back.
    assert resumed.status_code == 200 and resumed.json()["status"] in ("PENDING", "RUNNING"), resumed.text
    training.wait(
        job["id"],
        lambda j: any(
            e["message"].startswith(f"resuming from checkpoint {checkpoint_id}")
            for e in training.events(j["id"])
        ),
        "resumed",
    )
    assert training.http.delete(path, headers=training.train_headers).status_code == 200
    assert training.wait_final(job["id"])["status"] == "CANCELLED"


def test_two_jobs_with_one_trainer_run_one_after_the_other(training):
    file_id, held_out = training.upload(shout_samples(12)), training.upload(shout_samples(3))
    short = {"hyperparameters": {"epochs": 1, "batch_size": 4}}
    first = training.submit(spec(file_id, "first", **short)).json()
    second = training.submit(spec(file_id, "second", validation_file=held_out, **short)).json()
    first_done, second_done = training.wait_final(first["id"]), training.wait_final(second["id"])
    assert first_done["status"] == second_done["status"] == "COMPLETED"
    assert second_done["started_at"] >= first_done["finished_at"]
    # Without a validation file a tenth is held out (11 train: 3 steps); with one, all 12 train.
    assert (first_done["metrics"]["step"], second_done["metrics"]["step"]) == (3, 3)
    assert second_done["metrics"]["eval_loss"] is not None


def test_a_job_fails_with_its_reason_a_bad_sample_naming_its_line(training):
    file_id = training.upload(shout_samples())
    too_long = spec(file_id, "too-long", hyperparameters={"max_sequence_length": 8})
    failed = training.wait_final(training.submit(too_long).json()["id"])
    assert failed["status"] == "FAILED" and failed["error"].startswith(f"{file_id}:1: ")
    assert "longer than the 8" in failed["error"]

    # 5,400 steps of one sample (at most EXPERT_TRAINING_MAX_EPOCHS, 50, epochs of 108): far past 1 s.
    budget = spec(
        training.upload(shout_samples(120)),
        "out-of-time",
        hyperparameters={"epochs": 50, "batch_size": 1},
        time_budget_seconds=1,
    )
    spent = training.wait_final(training.submit(budget).json()["id"])
    assert spent["status"] == "FAILED" and "time budget of 1 s is spent" in spent["error"]


def test_an_expert_the_store_refuses_fails_its_job_and_a_resume_does_not_train_it_again(training):
    file_id = training.upload(shout_samples(8))
    short = {"hyperparameters": {"epochs": 1, "batch_size": 4}}
    taken = spec(file_id, "taken", **short)
    assert training.wait_final(training.submit(taken).json()["id"])["status"] == "COMPLETED"
    other = training.upload(shout_samples(9))  # other data: the same name and version, other weights
    job = training.submit(spec(other, "taken", **short)).json()
    failed = training.wait_final(job["id"])
    assert failed["status"] == "FAILED" and "taken@1.0.0" in failed["error"]

    resumed = training.http.post(f"/v1/training/jobs/{job['id']}/resume", headers=training.train_headers)
    assert resumed.status_code == 200, resumed.text
    again = training.wait_final(job["id"])
    assert again["status"] == "FAILED" and again["error"] == failed["error"]
    messages = [e["message"] for e in training.events(job["id"])]
    assert "the expert was trained and packed already" in messages


def test_whole_model_training_is_refused_by_name(training):
    file_id = training.upload(shout_samples())
    whole = spec(
        file_id, "whole", parallelism_config={"tensor_parallel_size": 8}, memory_config={"zero_stage": 3}
    )
    response = training.submit(whole)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "parallelism_config" and error["code"] == "invalid_argument"
    assert "out of scope" in error["message"] and "memory_config: ZeRO" in error["message"]


def test_a_job_over_a_bound_is_refused_naming_the_field(training):
    file_id = training.upload(shout_samples())
    over = spec(file_id, "too-big", hyperparameters={"epochs": 100_000, "max_sequence_length": 100_000})
    response = training.submit(over)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "hyperparameters.epochs" and error["code"] == "invalid_argument"
    for text in (
        "EXPERT_TRAINING_MAX_STEPS",
        "hyperparameters.max_sequence_length",
        "EXPERT_TRAINING_MAX_SEQUENCE_LENGTH",
    ):
        assert text in error["message"]

    with grpc.insecure_channel(training.stack.target("reception")) as channel:
        stub = training_pb2_grpc.TrainingServiceStub(channel)
        request = training_pb2.CreateTrainingJobRequest(
            spec=training_pb2.TrainingJobSpec(
                training_file=file_id,
                expert=training_pb2.TrainingExpertSpec(name="too-big"),
                hyperparameters=training_pb2.TrainingHyperparameters(epochs=100_000),
            )
        )
        with pytest.raises(grpc.RpcError) as refused:
            stub.CreateTrainingJob(request, metadata=[("authorization", f"Bearer {training.train_key}")])
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "hyperparameters.epochs" in refused.value.details()

    missing = training.submit(spec("file-000000000000000000000000", "nothing"))
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "training_file"


def test_only_a_train_key_changes_jobs_and_a_key_sees_only_its_own(training):
    file_id = training.upload(shout_samples())
    refused = training.submit(spec(file_id, "not-allowed"), headers=training.infer_headers)
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "permission_denied"
    with grpc.insecure_channel(training.stack.target("reception")) as channel:
        stub = training_pb2_grpc.TrainingServiceStub(channel)
        infer = [("authorization", training.infer_headers["authorization"])]
        with pytest.raises(grpc.RpcError) as denied:
            stub.CreateTrainingJob(training_pb2.CreateTrainingJobRequest(), metadata=infer)
        assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
        mine = stub.ListTrainingJobs(
            training_pb2.ListTrainingJobsRequest(),
            metadata=[("authorization", f"Bearer {training.train_key}")],
        )
        assert mine.jobs and all(j.id.startswith("ftjob-") for j in mine.jobs)
        theirs = stub.ListTrainingJobs(training_pb2.ListTrainingJobsRequest(), metadata=infer)
        assert list(theirs.jobs) == []
        job_id = mine.jobs[0].id
        with pytest.raises(grpc.RpcError) as hidden:
            stub.GetTrainingJob(training_pb2.GetTrainingJobRequest(job_id=job_id), metadata=infer)
        assert hidden.value.code() == grpc.StatusCode.NOT_FOUND
