"""OpenAI's fine-tuning API (docs/api.md#fine-tuning-api) driven by the real `openai` client against a
stack on the tiny model with the trainer worker as a real process (the shared `trainer_stack`,
with keys of this module's own): a JSONL file uploaded with
files.create, a job created, retrieved until it succeeded, its events and checkpoints listed, and
its `fine_tuned_model` called through chat.completions and listed by models.list; a queued job
cancelled; the fields a job cannot honour refused by name."""

from __future__ import annotations

import io
import json
import time

import openai
import pytest

from libs.gen.expert.v1 import keys_pb2
from tests.e2e.conftest import TrainerStack

DEADLINE_S = 300.0


@pytest.fixture(scope="module")
def stack(trainer_stack: TrainerStack):
    trainer_stack.trainer_running()
    return trainer_stack.stack


@pytest.fixture(scope="module")
def client(trainer_stack: TrainerStack, stack) -> openai.OpenAI:
    _, key = trainer_stack.create_key("fine-tuner", keys_pb2.KEY_SCOPE_TRAIN)
    with openai.OpenAI(base_url=stack.http_url() + "/v1", api_key=key, max_retries=0) as client:
        yield client
    trainer_stack.end_jobs(key)


@pytest.fixture(scope="module")
def training_file(client) -> str:
    # A task of its own (the other modules on the shared stack teach shouting words), so that the
    # router's retrieval adds none of their experts to a request that names this module's.
    lines = [
        {
            "messages": [
                {"role": "user", "content": f"Double the number {i}"},
                {"role": "assistant", "content": str(2 * i)},
            ]
        }
        for i in range(12)
    ]
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    return client.files.create(file=("double.jsonl", io.BytesIO(content)), purpose="fine-tune").id


def _until(client: openai.OpenAI, job_id: str, statuses: tuple[str, ...]):
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        job = client.fine_tuning.jobs.retrieve(job_id)
        if job.status in statuses:
            return job
        assert job.status in ("queued", "running"), job
        time.sleep(0.1)
    pytest.fail(f"job {job_id} never reached {statuses}: {client.fine_tuning.jobs.retrieve(job_id)}")


def _listed(client: openai.OpenAI, model: str) -> None:
    """Waits until /v1/models lists `model` (reception reuses the router's expert list for
    EXPERTS_TTL_S, so a just-registered expert shows up within that)."""
    deadline = time.monotonic() + DEADLINE_S
    while model not in (listed := [m.id for m in client.models.list().data]):
        if time.monotonic() > deadline:
            pytest.fail(f"/v1/models never listed {model}: {listed}")
        time.sleep(0.2)


def test_the_whole_loop_from_a_file_to_a_model_one_calls(client, training_file):
    base = client.models.list().data[0].id
    job = client.fine_tuning.jobs.create(
        model=base,
        training_file=training_file,
        suffix="double-ft",
        seed=3,
        method={"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 2, "batch_size": 4}}},
    )
    assert job.object == "fine_tuning.job" and job.status == "queued" and job.fine_tuned_model is None
    assert job.hyperparameters.n_epochs == 2 and job.hyperparameters.batch_size == 4
    assert job.hyperparameters.learning_rate_multiplier == 1 and job.seed == 3 and job.model == base
    assert job.id in [j.id for j in client.fine_tuning.jobs.list(limit=10).data]

    done = _until(client, job.id, ("succeeded", "failed", "cancelled"))
    assert done.status == "succeeded", done.error
    assert done.fine_tuned_model == f"{base}:double-ft"
    assert done.trained_tokens > 0 and done.finished_at >= done.created_at and done.error is None

    events = client.fine_tuning.jobs.list_events(job.id, limit=100).data
    assert all(e.object == "fine_tuning.job.event" for e in events)
    assert events[0].created_at >= events[-1].created_at  # newest first, as OpenAI lists them
    assert "installed" in events[0].message
    steps = [e.data["step"] for e in events if e.type == "metrics"]
    assert steps == sorted(steps, reverse=True) and steps[0] == max(steps) >= 2
    page = client.fine_tuning.jobs.list_events(job.id, limit=2)
    after = client.fine_tuning.jobs.list_events(job.id, limit=2, after=page.data[-1].id)
    assert page.has_more and [e.id for e in after.data] == [e.id for e in events[2:4]]

    checkpoints = client.fine_tuning.jobs.checkpoints.list(job.id).data
    assert checkpoints, "the trainer checkpoints at least at the end of a run"
    assert all(
        c.object == "fine_tuning.job.checkpoint" and c.fine_tuning_job_id == job.id for c in checkpoints
    )
    assert [c.step_number for c in checkpoints] == sorted((c.step_number for c in checkpoints), reverse=True)

    _listed(client, done.fine_tuned_model)
    answer = client.chat.completions.create(
        model=done.fine_tuned_model,
        messages=[{"role": "user", "content": "Double the number 99"}],
        max_tokens=4,
        temperature=0,
        # The tiny random model, a few steps trained, may well end its answer at once: without its
        # end token, its 4 tokens show that the named model answered.
        extra_body={"ignore_eos": True},
    )
    assert answer.model == done.fine_tuned_model and answer.choices[0].message.content
    assert answer.model_extra["expert_system"]["experts"] == ["double-ft"]


def test_a_queued_job_is_cancelled(client, training_file):
    base = client.models.list().data[0].id
    job = client.fine_tuning.jobs.create(model=base, training_file=training_file, suffix="to-cancel")
    cancelled = client.fine_tuning.jobs.cancel(job.id)
    # queued: cancelled at once; taken by the trainer meanwhile: stopped within a step
    assert cancelled.status in ("cancelled", "running")
    final = _until(client, job.id, ("cancelled",))
    assert final.finished_at is not None and final.fine_tuned_model is None


def test_what_a_job_cannot_honour_is_refused_by_name(client, training_file):
    base = client.models.list().data[0].id
    cases = [
        ({"method": {"type": "dpo"}}, "method.type"),
        ({"method": {"type": "reinforcement"}}, "method.type"),
        ({"integrations": [{"type": "wandb", "wandb": {"project": "p"}}]}, "integrations"),
        ({"hyperparameters": {"n_epochs": 0}}, "hyperparameters.n_epochs"),
        ({"suffix": "Not A Name!"}, "suffix"),
    ]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as refused:
            client.fine_tuning.jobs.create(model=base, training_file=training_file, **extra)
        assert refused.value.body["param"] == param, refused.value.body
        assert refused.value.body["code"] == "invalid_argument"
    with pytest.raises(openai.BadRequestError) as missing:
        client.fine_tuning.jobs.create(model=base, training_file="file-nothere")
    assert missing.value.body["param"] == "training_file"
    with pytest.raises(openai.NotFoundError):
        client.fine_tuning.jobs.retrieve("ftjob-nothere")


def test_only_a_train_key_creates_a_job(trainer_stack, stack, client, training_file):
    _, reader = trainer_stack.create_key("reader", keys_pb2.KEY_SCOPE_INFER)
    with openai.OpenAI(base_url=stack.http_url() + "/v1", api_key=reader, max_retries=0) as other:
        with pytest.raises(openai.PermissionDeniedError):
            other.fine_tuning.jobs.create(model="any", training_file=training_file)
        assert other.fine_tuning.jobs.list().data == []  # another key's jobs are not its own
