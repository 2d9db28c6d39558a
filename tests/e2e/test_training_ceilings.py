"""Training specs and files have ceilings (docs/api.md#training-jobs, #fine-tuning-api, #files-api),
on a real reception process with EXPERT_AUTH=required over a real redis-server: no trainer, since
every refusal here comes at submission. Each out-of-range field of a job is refused naming it, over
REST, gRPC and OpenAI's fine-tuning API; a training file with a line nested 10,000 deep or a string
holding a lone surrogate is refused at upload naming the line; and a job stored before the ceilings
(a learning rate of 1e308, a NaN loss, text UTF-8 cannot hold) lists without failing the listing."""

from __future__ import annotations

import json

import grpc
import httpx
import openai
import pytest
from google.protobuf.json_format import ParseDict
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from redis import Redis

from libs.auth.metadata import credentials_metadata
from libs.gen.expert.v1 import (
    files_pb2,
    files_pb2_grpc,
    keys_pb2,
    keys_pb2_grpc,
    training_pb2,
    training_pb2_grpc,
)
from tools.stack import LocalStack

TOKEN = "e2e-ceilings-token-0123456789abcdef"
GOOD = (
    json.dumps({"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]})
    + "\n"
    + json.dumps({"prompt": "Capital of France?", "completion": "Paris"})
    + "\n"
).encode()
DEEP_LINE = b'{"messages": ' + b"[" * 10_000 + b"]" * 10_000 + b"}\n"
# The JSON text holds the escape, as a client's serializer writes a lone surrogate.
SURROGATE_LINE = (
    b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "\\ud800"}]}\n'
)

# (the field as the REST/gRPC spec names it, the spec's part that takes it over its ceiling)
OVER = [
    ("adapter.rank", {"adapter": {"rank": 10_000}}),
    ("adapter.rank", {"adapter": {"rank": 2**63}}),
    ("adapter.alpha", {"adapter": {"alpha": 1e308}}),
    ("adapter.dropout", {"adapter": {"dropout": 1e308}}),
    ("adapter.num_virtual_tokens", {"adapter": {"type": "prompt_tuning", "num_virtual_tokens": 10**9}}),
    (
        "adapter.num_virtual_tokens",
        {
            "adapter": {"type": "prompt_tuning", "num_virtual_tokens": 512},
            "hyperparameters": {"max_sequence_length": 256},
        },
    ),
    ("adapter.target_modules", {"adapter": {"target_modules": ["nope"]}}),
    ("adapter.target_modules", {"adapter": {"type": "prompt_tuning", "target_modules": ["q_proj"]}}),
    (
        "adapter.feedforward_modules",
        {"adapter": {"type": "ia3", "target_modules": ["q_proj"], "feedforward_modules": ["q_proj"]}},
    ),
    ("hyperparameters.batch_size", {"hyperparameters": {"batch_size": 10**9}}),
    ("hyperparameters.epochs", {"hyperparameters": {"epochs": 51}}),
    ("hyperparameters.learning_rate", {"hyperparameters": {"learning_rate": 1e308}}),
    ("hyperparameters.patience", {"hyperparameters": {"patience": 10**9}}),
    ("hyperparameters.seed", {"hyperparameters": {"seed": 2**40}}),
    ("hyperparameters.max_steps", {"hyperparameters": {"max_steps": 10**9}}),
    ("hyperparameters.eval_fraction", {"hyperparameters": {"eval_fraction": 1e300}}),
    ("checkpoint_every_steps", {"checkpoint_every_steps": 10**9}),
    ("time_budget_seconds", {"time_budget_seconds": 10**12}),
    ("expert.name", {"expert": {"name": "A B/../x"}}),
    ("expert.version", {"expert": {"name": "fine", "version": "1.0." + "0" * 1000}}),
    ("base_model", {"base_model": "m" * 1_000}),
    # SemVer, but too long to name the store's file (index/<name>/<version>.json) by
    ("expert.version", {"expert": {"name": "fine", "version": "1.0.0-" + "a" * 994}}),
    ("expert.description", {"expert": {"name": "fine", "description": "d" * 1_000_000}}),
    ("expert.keywords[0]", {"expert": {"name": "fine", "keywords": ["k" * 1000]}}),
    ("expert.description", {"expert": {"name": "fine", "description": "\ud800"}}),
]


class Reception:
    def __init__(self, stack: LocalStack) -> None:
        self.stack = stack
        self.http = httpx.Client(base_url=stack.http_url(), timeout=30)
        self.key = self._key("trainer")
        self.headers = {"authorization": f"Bearer {self.key}"}
        self.file_id = self.upload("good.jsonl", GOOD).json()["id"]

    def _key(self, name: str) -> str:
        with grpc.insecure_channel(self.stack.target("reception")) as channel:
            response = keys_pb2_grpc.KeyServiceStub(channel).CreateKey(
                keys_pb2.CreateKeyRequest(name=name, scope=keys_pb2.KEY_SCOPE_TRAIN),
                metadata=credentials_metadata(internal_token=TOKEN),
                timeout=10,
            )
        return response.secret

    def upload(self, filename: str, content: bytes) -> httpx.Response:
        files = {"file": (filename, content), "purpose": (None, "fine-tune")}
        return self.http.post("/v1/files", files=files, headers=self.headers)

    def submit(self, spec: dict) -> httpx.Response:
        """POST /v1/training/jobs; the body's JSON escapes what UTF-8 cannot hold, as a client's does."""
        headers = {**self.headers, "content-type": "application/json"}
        return self.http.post("/v1/training/jobs", content=json.dumps(spec), headers=headers)

    def spec(self, changes: dict) -> dict:
        """A job spec that is within every ceiling but for `changes` (merged one level down)."""
        spec = {"training_file": self.file_id, "expert": {"name": "ceilings"}}
        for key, value in changes.items():
            spec[key] = {**spec[key], **value} if isinstance(spec.get(key), dict) else value
        return spec

    def grpc(self, service, method: str, request):
        """A call with the train key; its response, or the gRPC error it raised."""
        with grpc.insecure_channel(self.stack.target("reception")) as channel:
            try:
                return getattr(service(channel), method)(
                    request, metadata=[("authorization", f"Bearer {self.key}")], timeout=10
                )
            except grpc.RpcError as error:
                return error

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.stack.http_url() + "/v1", api_key=self.key, max_retries=0, timeout=30
        )


@pytest.fixture(scope="module")
def reception(tmp_path_factory):
    env = {"EXPERT_AUTH": "required", "EXPERT_INTERNAL_TOKEN": TOKEN}
    stack = LocalStack.on_free_ports(tmp_path_factory.mktemp("training-ceilings"), env=env)
    try:
        stack.start_redis()
        stack.start_service("reception")
        stack.wait_serving("reception", timeout=60)
        yield Reception(stack)
    finally:
        stack.stop()


def _violations(error: grpc.RpcError) -> list[tuple[str, str]]:
    detail = rpc_status.from_call(error).details[0]
    bad = error_details_pb2.BadRequest.FromString(detail.value)
    return [(v.field, v.description) for v in bad.field_violations]


@pytest.mark.parametrize(("field", "changes"), OVER, ids=[f"{f}-{i}" for i, (f, _) in enumerate(OVER)])
def test_a_field_over_its_ceiling_is_refused_by_name_at_submission(reception, field, changes):
    answer = reception.submit(reception.spec(changes))
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == field and error["code"] == "invalid_argument", error
    assert len(error["message"]) < 2000, "the refusal does not echo a megabyte back"


@pytest.mark.parametrize(
    ("field", "changes"),
    [
        ("adapter.rank", {"adapter": {"rank": 10_000}}),
        ("adapter.alpha", {"adapter": {"alpha": "Infinity"}}),  # ParseDict's spelling of inf
        ("adapter.target_modules", {"adapter": {"target_modules": ["nope"]}}),
        ("hyperparameters.learning_rate", {"hyperparameters": {"learning_rate": 1e308}}),
        ("hyperparameters.batch_size", {"hyperparameters": {"batch_size": 2**31 - 1}}),
        ("expert.name", {"expert": {"name": "A B/../x"}}),
        ("expert.version", {"expert": {"name": "fine", "version": "v" * 1000}}),
    ],
)
def test_grpc_refuses_the_same_fields_with_their_violations(reception, field, changes):
    spec = ParseDict(reception.spec(changes), training_pb2.TrainingJobSpec())
    refused = reception.grpc(
        training_pb2_grpc.TrainingServiceStub,
        "CreateTrainingJob",
        training_pb2.CreateTrainingJobRequest(spec=spec),
    )
    assert isinstance(refused, grpc.RpcError) and refused.code() == grpc.StatusCode.INVALID_ARGUMENT, refused
    assert _violations(refused)[0][0] == field


@pytest.mark.parametrize(
    ("hyperparameters", "param"),
    [
        ({"n_epochs": 51}, "hyperparameters.n_epochs"),
        ({"batch_size": 10**9}, "hyperparameters.batch_size"),
        ({"learning_rate_multiplier": 1e300}, "hyperparameters.learning_rate_multiplier"),
        ({"learning_rate_multiplier": 11}, "hyperparameters.learning_rate_multiplier"),
    ],
)
def test_openais_fine_tuning_api_names_the_openai_param(reception, hyperparameters, param):
    client = reception.openai()
    base = "any-model"  # refused before the model is looked at
    with pytest.raises(openai.BadRequestError) as refused:
        client.fine_tuning.jobs.create(
            model=base, training_file=reception.file_id, hyperparameters=hyperparameters
        )
    assert refused.value.body["param"] == param, refused.value.body
    with pytest.raises(openai.BadRequestError) as refused:
        client.fine_tuning.jobs.create(
            model=base,
            training_file=reception.file_id,
            method={"type": "supervised", "supervised": {"hyperparameters": hyperparameters}},
        )
    assert refused.value.body["param"] == param.replace(
        "hyperparameters", "method.supervised.hyperparameters"
    )
    with pytest.raises(openai.BadRequestError) as refused:
        client.fine_tuning.jobs.create(model=base, training_file=reception.file_id, seed=2**40)
    assert refused.value.body["param"] == "seed"


def test_a_line_nested_ten_thousand_deep_is_refused_at_upload_naming_it(reception):
    answer = reception.upload("deep.jsonl", GOOD + DEEP_LINE)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "file" and error["code"] == "invalid_file", error
    assert "deep.jsonl:3: nested too deeply" in error["message"], error
    upload = files_pb2.UploadTrainingFileRequest(
        filename="deep.jsonl", purpose="fine-tune", content=DEEP_LINE
    )
    refused = reception.grpc(files_pb2_grpc.TrainingFileServiceStub, "UploadTrainingFile", upload)
    assert isinstance(refused, grpc.RpcError) and refused.code() == grpc.StatusCode.INVALID_ARGUMENT, refused
    assert "deep.jsonl:1: nested too deeply" in _violations(refused)[0][1]


def test_a_lone_surrogate_in_a_line_is_refused_at_upload_naming_line_and_field(reception):
    answer = reception.upload("surrogate.jsonl", GOOD + SURROGATE_LINE)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "file" and error["code"] == "invalid_file", error
    assert "surrogate.jsonl:3: messages[1].content: not valid Unicode text" in error["message"], error
    keyed = b'{"prompt": "a", "completion": "b", "\\udfff": "c"}\n'
    upload = files_pb2.UploadTrainingFileRequest(filename="keyed.jsonl", purpose="fine-tune", content=keyed)
    refused = reception.grpc(files_pb2_grpc.TrainingFileServiceStub, "UploadTrainingFile", upload)
    assert isinstance(refused, grpc.RpcError) and refused.code() == grpc.StatusCode.INVALID_ARGUMENT, refused
    assert "keyed.jsonl:1: not valid Unicode text: a key holds a lone surrogate" in _violations(refused)[0][1]


def test_a_job_stored_before_the_ceilings_never_fails_the_listing(reception):
    """A record as the code before the ceilings stored it: a learning rate of 1e308 (its multiplier
    overflows to inf), a NaN loss in its metrics and events, text UTF-8 cannot hold in its spec."""
    created = reception.http.post("/v1/training/jobs", json=reception.spec({}), headers=reception.headers)
    assert created.status_code == 201, created.text
    job_id = created.json()["id"]
    redis = Redis.from_url(reception.stack.redis_url)
    try:
        spec = created.json()["spec"]
        spec["hyperparameters"]["learning_rate"] = 1e308
        redis.hset(f"expert:training:job:{job_id}", "spec", json.dumps(spec))
        redis.hset(
            f"expert:training:job:{job_id}",
            "metrics",
            '{"step": 1, "train_loss": NaN, "eta_seconds": Infinity}',
        )
        redis.xadd(
            f"expert:training:job:{job_id}:events",
            {"type": "progress", "message": "step 1", "data": '{"train_loss": NaN}', "created_at": "1.0"},
        )
        surrogate = {**spec, "expert": {**spec["expert"], "description": "\\ud800"}}
        other = reception.http.post(
            "/v1/training/jobs", json=reception.spec({}), headers=reception.headers
        ).json()["id"]
        redis.hset(
            f"expert:training:job:{other}", "spec", json.dumps(surrogate).replace("\\\\ud800", "\\ud800")
        )
    finally:
        redis.close()

    client = reception.openai()
    listed = {job.id: job for job in client.fine_tuning.jobs.list(limit=100).data}
    assert {job_id, other} <= set(listed)
    assert listed[job_id].hyperparameters.learning_rate_multiplier is None
    assert client.fine_tuning.jobs.retrieve(job_id).id == job_id
    events = client.fine_tuning.jobs.list_events(job_id).data
    assert [e.data.get("train_loss", "absent") for e in events if e.type == "metrics"] == [None]

    rest = reception.http.get("/v1/training/jobs", params={"limit": 100}, headers=reception.headers)
    assert rest.status_code == 200, rest.text
    shown = {job["id"]: job for job in rest.json()["data"]}
    assert shown[job_id]["metrics"]["train_loss"] is None
    assert shown[other]["spec"] == {}, "a spec UTF-8 cannot hold is not shown, the job is"
    listing = reception.grpc(
        training_pb2_grpc.TrainingServiceStub,
        "ListTrainingJobs",
        training_pb2.ListTrainingJobsRequest(limit=100),
    )
    assert not isinstance(listing, grpc.RpcError), listing
    assert {job_id, other} <= {job.id for job in listing.jobs}
