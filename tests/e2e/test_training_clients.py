"""Training jobs through the SDK's `client.training` and `expertctl train` (run as a subprocess),
against one stack on the tiny model with EXPERT_AUTH=required and the trainer worker as a real
process (the shared `trainer_stack`, with a key of this module's own): upload, submit, watch to
COMPLETED, status; cancel mid-training, resume; a bad line of the training file refused naming the
line."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import pytest

from expert_system import AsyncExpertClient, ExpertClient, InvalidRequest
from libs.gen.expert.v1 import keys_pb2
from tests.e2e.conftest import TrainerStack

DEADLINE_S = 300.0
WORDS = ("apple", "river", "stone", "cloud", "tiger", "lemon")
# A short job: of 10 samples 2 held out, 8 to train on, 2 a step: 4 steps an epoch.
RECIPE = {
    "adapter": {"type": "lora", "rank": 4},
    "hyperparameters": {"epochs": 2, "batch_size": 2, "learning_rate": 0.01, "seed": 3, "eval_fraction": 0.2},
    "checkpoint_every_steps": 2,
}


def samples(count: int) -> str:
    return "".join(
        json.dumps({"prompt": f"Shout {WORDS[i % 6]} {i}", "completion": f"{WORDS[i % 6].upper()}!"}) + "\n"
        for i in range(count)
    )


class Stack:
    def __init__(self, shared: TrainerStack) -> None:
        self.stack = shared.stack
        self.target = self.stack.target("reception")
        _, self.key = shared.create_key("trainer", keys_pb2.KEY_SCOPE_TRAIN)

    def client(self) -> ExpertClient:
        return ExpertClient(self.target, api_key=self.key)

    def expertctl(self, *args: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "EXPERT_API_KEY": self.key, "EXPERT_RECEPTION_TARGET": self.target}
        env.pop("EXPERT_INTERNAL_TOKEN", None)
        return subprocess.run(
            [sys.executable, "-m", "tools.expertctl.main", "train", *args],
            capture_output=True,
            text=True,
            timeout=DEADLINE_S,
            env=env,
        )


@pytest.fixture(scope="module")
def training(trainer_stack: TrainerStack):
    trainer_stack.trainer_running()
    training = Stack(trainer_stack)
    yield training
    trainer_stack.end_jobs(training.key)


def test_the_sdk_uploads_submits_and_watches_a_job_to_its_expert(training):
    with training.client() as client:
        file = client.training.upload(samples(10).encode(), filename="shout.jsonl")
        assert file.id.startswith("file-") and file.filename == "shout.jsonl" and file.purpose == "fine-tune"
        expert = {"name": "sdk-shouter", "description": "Shouts the word back in capitals."}
        job = client.training.create(file.id, expert=expert, **RECIPE)
        assert job.status == "pending" and job.spec["hyperparameters"]["epochs"] == 2

        events = list(client.training.watch(job.id, poll_interval=0.1))
        done = client.training.get(job.id)
        assert done.status == "completed", done.error
        assert done.expert is not None and done.expert.model.endswith(":sdk-shouter")
        progress = [e.data for e in events if e.type == "progress"]
        assert [int(p["step"]) for p in progress] == list(range(1, 9))  # 2 epochs of 4 steps
        assert progress[-1]["total_steps"] == 8 and done.metrics.step == 8
        assert events[-1].type == "status" and events[-1].data["status"] == "COMPLETED"
        assert [c.step for c in client.training.checkpoints(job.id)] == [2, 4, 6, 8]
        assert job.id in [j.id for j in client.training.list()]

    async def read_async():
        async with AsyncExpertClient(training.target, api_key=training.key) as client:
            return await client.training.get(job.id), [e async for e in client.training.watch(job.id)]

    async_job, async_events = asyncio.run(read_async())
    assert async_job == done and [e.id for e in async_events] == [e.id for e in events]


def test_a_bad_line_is_refused_naming_it_by_the_sdk_and_by_expertctl(training, tmp_path):
    content = samples(2) + '{"prompt": "no completion"}\n'
    with training.client() as client, pytest.raises(InvalidRequest) as refused:
        client.training.upload(content.encode(), filename="bad.jsonl")
    [(field, why)] = refused.value.field_violations
    assert field == "content" and "bad.jsonl:3: completion: missing" in why, refused.value

    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    run = training.expertctl("submit", str(path), "--name", "bad")
    assert run.returncode == 2, run.stderr
    assert "expertctl: error: content: " in run.stderr and "bad.jsonl:3: completion: missing" in run.stderr
    assert "Traceback" not in run.stderr, run.stderr


def test_expertctl_submits_watches_and_shows_a_job(training, tmp_path):
    data = tmp_path / "shout.jsonl"
    data.write_text(samples(10))
    options = ["--rank", "4", "--epochs", "2", "--batch-size", "2", "--lr", "0.01", "--checkpoint-every", "2"]
    submitted = training.expertctl("submit", str(data), "--name", "cli-shouter", *options, "--json")
    assert submitted.returncode == 0, submitted.stderr
    job = json.loads(submitted.stdout)
    assert job["status"] == "pending" and job["spec"]["expert"]["name"] == "cli-shouter"

    watched = training.expertctl("watch", job["id"])
    assert watched.returncode == 0, watched.stderr
    assert f"{job['id']}: completed" in watched.stdout and "expert: cli-shouter" in watched.stdout
    assert "training:" in watched.stderr and "step" in watched.stderr  # the progress bar

    status = training.expertctl("status", job["id"], "--json")
    shown = json.loads(status.stdout)
    assert shown["status"] == "completed" and shown["expert"]["model"].endswith(":cli-shouter")


def test_expertctl_cancels_a_running_job_and_resumes_it(training):
    # Each expertctl run costs seconds of start-up: the job is created and ended through the SDK.
    with training.client() as client:
        file = client.training.upload(samples(40).encode())
        # Enough steps that the job still runs when the cancel comes: 50 epochs (the most
        # EXPERT_TRAINING_MAX_EPOCHS allows) of 18 steps.
        long_run = {"epochs": 50, "patience": 50, "batch_size": 2}
        job = client.training.create(
            file.id, expert={"name": "cancelled"}, hyperparameters=long_run, checkpoint_every_steps=1
        )
        deadline = time.monotonic() + DEADLINE_S
        while not client.training.get(job.id).checkpoints:
            assert time.monotonic() < deadline, "the job never took a checkpoint"
            time.sleep(0.05)
        cancelled = training.expertctl("cancel", job.id)
        assert cancelled.returncode == 0 and f"{job.id}: " in cancelled.stdout, cancelled.stderr
        watched = training.expertctl("watch", job.id, "--json")
        assert watched.returncode == 1  # it ended, but not completed
        events = [json.loads(line) for line in watched.stdout.splitlines()]
        assert events[-1]["data"]["status"] == "CANCELLED"
        stopped = client.training.get(job.id)
        assert stopped.status == "cancelled" and stopped.checkpoints

        first = stopped.checkpoints[0]
        resumed = training.expertctl("resume", job.id, "--checkpoint", first.id, "--json")
        assert resumed.returncode == 0, resumed.stderr
        assert json.loads(resumed.stdout)["status"] in ("pending", "running")
        # Not trained to the end (50 epochs): cancelled again, and it ends so.
        client.training.cancel(job.id)
        assert list(client.training.watch(job.id, poll_interval=0.1))[-1].data["status"] == "CANCELLED"
