"""OpenAI's Files API (training data) driven by the real `openai` client, on a real reception process
with EXPERT_AUTH=required over a real redis-server (no other service: the files need none): a file
goes up, is listed, read back byte for byte and deleted; a bad line is refused naming its line and
field; a file over EXPERT_TRAINING_FILE_MAX_BYTES is refused (413); an inference key gets 403; and a
file is invisible to every key but its owner's (docs/api.md#files-api); and gRPC's
TrainingFileService over the same files, with the same checks (docs/api.md, TrainingFileService)."""

from __future__ import annotations

import json
import time

import grpc
import httpx
import openai
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from redis import Redis

from libs.auth.metadata import credentials_metadata
from libs.gen.expert.v1 import files_pb2, files_pb2_grpc, keys_pb2, keys_pb2_grpc
from tools.stack import LocalStack, free_port, health_status

TOKEN = "e2e-internal-token-0123456789abcdef"
CAP = 64 * 1024  # EXPERT_TRAINING_FILE_MAX_BYTES here
PER_OWNER = 3  # EXPERT_TRAINING_FILES_PER_OWNER here

CHAT = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}
PROMPT = {"prompt": "Capital of France?", "completion": "Paris"}
GOOD = (json.dumps(CHAT) + "\n" + json.dumps(PROMPT) + "\n").encode()


class Reception:
    def __init__(self, stack: LocalStack) -> None:
        self.stack = stack
        self.url = stack.http_url() + "/v1"

    def key(self, name: str, scope: int) -> str:
        """A new API key of `scope`, made with the internal token as an operator makes the first key."""
        with grpc.insecure_channel(self.stack.target("reception")) as channel:
            response = keys_pb2_grpc.KeyServiceStub(channel).CreateKey(
                keys_pb2.CreateKeyRequest(name=name, scope=scope),
                metadata=credentials_metadata(internal_token=TOKEN),
                timeout=10,
            )
        return response.secret

    def client(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key=key, max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def reception(tmp_path_factory):
    env = {
        "EXPERT_AUTH": "required",
        "EXPERT_INTERNAL_TOKEN": TOKEN,
        "EXPERT_TRAINING_FILE_MAX_BYTES": str(CAP),
        "EXPERT_TRAINING_FILES_PER_OWNER": str(PER_OWNER),
        # Below the file cap: an upload is bounded by its own setting, not by this one.
        "EXPERT_HTTP_MAX_BODY_BYTES": str(CAP // 4),
    }
    stack = LocalStack.on_free_ports(tmp_path_factory.mktemp("files-api"), env=env)
    try:
        stack.start_redis()
        stack.start_service("reception")
        stack.wait_serving("reception", timeout=60)
        yield Reception(stack)
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def trainer(reception) -> openai.OpenAI:
    return reception.client(reception.key("trainer", keys_pb2.KEY_SCOPE_TRAIN))


def _error(exc: openai.APIStatusError) -> dict:
    return exc.response.json()["error"]


def test_the_openai_client_uploads_lists_reads_and_deletes_a_file(trainer, tmp_path):
    path = tmp_path / "math.jsonl"
    path.write_bytes(GOOD)
    with path.open("rb") as handle:
        created = trainer.files.create(file=handle, purpose="fine-tune")
    assert created.id.startswith("file-") and created.object == "file"
    assert (created.filename, created.purpose, created.status) == ("math.jsonl", "fine-tune", "processed")
    assert created.bytes == len(GOOD) and created.created_at > 0
    second = trainer.files.create(file=("more.jsonl", GOOD), purpose="fine-tune")

    assert [f.id for f in trainer.files.list()] == [second.id, created.id]  # newest first, as OpenAI
    first_page = trainer.files.list(order="asc", limit=1)
    assert [f.id for f in first_page.data] == [created.id] and first_page.has_more
    # the client follows the pages (`after` the last id)
    assert [f.id for f in trainer.files.list(order="asc", limit=1)] == [created.id, second.id]
    assert trainer.files.retrieve(created.id) == created
    assert trainer.files.content(created.id).content == GOOD

    deleted = trainer.files.delete(created.id)
    assert (deleted.id, deleted.deleted) == (created.id, True)
    with pytest.raises(openai.NotFoundError) as gone:
        trainer.files.retrieve(created.id)
    assert _error(gone.value)["code"] == "file_not_found"
    assert [f.id for f in trainer.files.list()] == [second.id]
    trainer.files.delete(second.id)


def test_a_bad_line_is_refused_naming_its_line_and_field_and_nothing_is_kept(trainer):
    bad = GOOD + b"\n" + json.dumps({"prompt": "Capital of Spain?"}).encode() + b"\n"  # line 4
    with pytest.raises(openai.BadRequestError) as refused:
        trainer.files.create(file=("bad.jsonl", bad), purpose="fine-tune")
    error = _error(refused.value)
    assert error["param"] == "file" and error["code"] == "invalid_file", error
    assert "bad.jsonl:4: completion: missing" in error["message"], error
    not_json = b'{"prompt": "a", "completion": "b"}\n{"prompt": \n'
    with pytest.raises(openai.BadRequestError) as refused:
        trainer.files.create(file=("broken.jsonl", not_json), purpose="fine-tune")
    assert "broken.jsonl:2: not valid JSON" in _error(refused.value)["message"]
    with pytest.raises(openai.BadRequestError) as refused:
        trainer.files.create(file=("batch.jsonl", GOOD), purpose="batch")
    assert _error(refused.value)["param"] == "purpose"
    assert list(trainer.files.list()) == []


def test_a_file_over_the_cap_is_refused_with_413(trainer, reception):
    line = json.dumps({"prompt": "x" * 100, "completion": "y"}).encode() + b"\n"
    just_over = line * (CAP // len(line)) + b" " * (CAP % len(line) + 1)  # CAP + 1 bytes
    assert len(just_over) == CAP + 1
    with pytest.raises(openai.APIStatusError) as refused:
        trainer.files.create(file=("big.jsonl", just_over), purpose="fine-tune")
    assert refused.value.status_code == 413
    error = _error(refused.value)
    assert error["param"] == "file" and "EXPERT_TRAINING_FILE_MAX_BYTES" in error["message"], error
    # Far over: refused by its Content-Length, before the form is read.
    with pytest.raises(openai.APIStatusError) as refused:
        trainer.files.create(file=("huge.jsonl", line * 20_000), purpose="fine-tune")
    assert refused.value.status_code == 413
    assert "EXPERT_TRAINING_FILE_MAX_BYTES" in _error(refused.value)["message"]
    # Far over and sent without a Content-Length (chunked): refused at the first byte over.
    boundary = "expert-test-boundary"
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nfine-tune\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="s.jsonl"\r\n'
        "Content-Type: application/octet-stream\r\n\r\n"
    ).encode()

    def chunks():
        yield head
        for _ in range(CAP // len(line) * 4):
            yield line

    answer = httpx.post(
        reception.url + "/files",
        content=chunks(),
        headers={
            "authorization": f"Bearer {trainer.api_key}",
            "content-type": f"multipart/form-data; boundary={boundary}",
        },
        timeout=30,
    )
    assert answer.status_code == 413 and "EXPERT_TRAINING_FILE_MAX_BYTES" in answer.text, answer.text
    # Exactly at the cap (4 times EXPERT_HTTP_MAX_BODY_BYTES here): kept.
    at_cap = trainer.files.create(file=("cap.jsonl", just_over[:-1]), purpose="fine-tune")
    assert at_cap.bytes == CAP
    trainer.files.delete(at_cap.id)


def test_an_inference_key_gets_403_and_another_key_sees_nothing(trainer, reception):
    mine = trainer.files.create(file=("mine.jsonl", GOOD), purpose="fine-tune")
    infer = reception.client(reception.key("inference", keys_pb2.KEY_SCOPE_INFER))
    with pytest.raises(openai.PermissionDeniedError) as denied:
        infer.files.create(file=("x.jsonl", GOOD), purpose="fine-tune")
    assert "needs train" in _error(denied.value)["message"]
    with pytest.raises(openai.PermissionDeniedError):
        infer.files.list()

    other = reception.client(reception.key("other trainer", keys_pb2.KEY_SCOPE_TRAIN))
    assert list(other.files.list()) == []
    for call in (other.files.retrieve, other.files.content, other.files.delete):
        with pytest.raises(openai.NotFoundError):
            call(mine.id)
    assert trainer.files.content(mine.id).content == GOOD  # still there, its owner's
    trainer.files.delete(mine.id)


def test_a_body_that_is_not_a_multipart_form_is_refused_clearly(reception):
    key = reception.key("curl user", keys_pb2.KEY_SCOPE_TRAIN)
    headers = {"authorization": f"Bearer {key}"}
    answer = httpx.post(reception.url + "/files", json={"file": "x"}, headers=headers, timeout=10)
    assert answer.status_code == 415 and "multipart/form-data" in answer.json()["error"]["message"]
    answer = httpx.post(
        reception.url + "/files", files={"purpose": (None, "fine-tune")}, headers=headers, timeout=10
    )
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "file", answer.text
    answer = httpx.post(
        reception.url + "/files",
        files={
            "file": ("a.jsonl", GOOD),
            "purpose": (None, "fine-tune"),
            "expires_after[anchor]": (None, "created_at"),
        },
        headers=headers,
        timeout=10,
    )
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "expires_after", answer.text
    for query in ("limit=0", "limit=ten", "limit=" + "9" * 5000, "limit=%C2%B2", "order=up"):
        answer = httpx.get(reception.url + "/files?" + query, headers=headers, timeout=10)
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["param"] == query.split("=")[0], answer.text


def test_a_full_redis_refuses_the_upload_with_507_and_keeps_serving(trainer, reception):
    """Files have no TTL, so Redis at its maxmemory evicts none of them: the upload is refused."""
    redis = Redis.from_url(reception.stack.redis_url)
    cap = redis.config_get("maxmemory")["maxmemory"]
    try:
        redis.config_set("maxmemory", redis.info("memory")["used_memory"] + 1024)
        line = json.dumps({"prompt": "x" * 1000, "completion": "y"}).encode() + b"\n"
        with pytest.raises(openai.APIStatusError) as refused:
            trainer.files.create(file=("full.jsonl", line * 50), purpose="fine-tune")
        assert refused.value.status_code == 507, refused.value.response.text
        assert _error(refused.value)["code"] == "insufficient_storage"
    finally:
        redis.config_set("maxmemory", cap)
        redis.close()
    assert list(trainer.files.list()) == []


def _grpc(reception, method: str, request, key: str):
    """A TrainingFileService call with `key`; the response, or the gRPC error it raised."""
    with grpc.insecure_channel(reception.stack.target("reception")) as channel:
        stub = files_pb2_grpc.TrainingFileServiceStub(channel)
        try:
            return getattr(stub, method)(request, metadata=[("authorization", f"Bearer {key}")], timeout=10)
        except grpc.RpcError as error:
            return error


def test_grpc_users_upload_the_same_files_with_the_same_checks(trainer, reception):
    key = trainer.api_key
    upload = files_pb2.UploadTrainingFileRequest(filename="rpc.jsonl", purpose="fine-tune", content=GOOD)
    kept = _grpc(reception, "UploadTrainingFile", upload, key).file
    assert kept.file_id.startswith("file-") and kept.bytes == len(GOOD) and kept.filename == "rpc.jsonl"
    # One store: the HTTP front sees the gRPC upload.
    assert trainer.files.retrieve(kept.file_id).bytes == len(GOOD)
    listed = _grpc(reception, "ListTrainingFiles", files_pb2.ListTrainingFilesRequest(), key)
    assert [f.file_id for f in listed.files] == [kept.file_id]
    read = files_pb2.GetTrainingFileContentRequest(file_id=kept.file_id)
    assert _grpc(reception, "GetTrainingFileContent", read, key).content == GOOD

    bad = files_pb2.UploadTrainingFileRequest(
        filename="rpc.jsonl", purpose="fine-tune", content=GOOD + b'{"messages": []}\n'
    )
    refused = _grpc(reception, "UploadTrainingFile", bad, key)
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    violation = rpc_status.from_call(refused).details[0]
    field = error_details_pb2.BadRequest.FromString(violation.value).field_violations[0]
    assert field.field == "content" and "rpc.jsonl:3: messages: must be a non-empty list" in field.description
    too_big = files_pb2.UploadTrainingFileRequest(
        filename="b.jsonl", purpose="fine-tune", content=b" " * (CAP + 1)
    )
    refused = _grpc(reception, "UploadTrainingFile", too_big, key)
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "EXPERT_TRAINING_FILE_MAX_BYTES" in refused.details()
    batch = files_pb2.UploadTrainingFileRequest(filename="b.jsonl", purpose="batch", content=GOOD)
    assert "purpose" in _grpc(reception, "UploadTrainingFile", batch, key).details()

    infer_key = reception.key("rpc inference", keys_pb2.KEY_SCOPE_INFER)
    denied = _grpc(reception, "ListTrainingFiles", files_pb2.ListTrainingFilesRequest(), infer_key)
    assert denied.code() == grpc.StatusCode.PERMISSION_DENIED
    other = reception.key("rpc other", keys_pb2.KEY_SCOPE_TRAIN)
    delete = files_pb2.DeleteTrainingFileRequest(file_id=kept.file_id)
    assert _grpc(reception, "DeleteTrainingFile", delete, other).code() == grpc.StatusCode.NOT_FOUND
    assert _grpc(reception, "DeleteTrainingFile", delete, key).file.file_id == kept.file_id
    get = files_pb2.GetTrainingFileRequest(file_id=kept.file_id)
    assert _grpc(reception, "GetTrainingFile", get, key).code() == grpc.StatusCode.NOT_FOUND


def test_a_key_keeps_at_most_its_share_of_files(reception):
    client = reception.client(reception.key("hoarder", keys_pb2.KEY_SCOPE_TRAIN))
    kept = [client.files.create(file=(f"{i}.jsonl", GOOD), purpose="fine-tune") for i in range(PER_OWNER)]
    with pytest.raises(openai.BadRequestError) as refused:
        client.files.create(file=("one-more.jsonl", GOOD), purpose="fine-tune")
    error = _error(refused.value)
    assert error["code"] == "too_many_files" and "EXPERT_TRAINING_FILES_PER_OWNER" in error["message"], error
    assert len(list(client.files.list())) == PER_OWNER
    upload = files_pb2.UploadTrainingFileRequest(filename="rpc.jsonl", purpose="fine-tune", content=GOOD)
    refused_rpc = _grpc(reception, "UploadTrainingFile", upload, client.api_key)
    assert refused_rpc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused_rpc
    assert "EXPERT_TRAINING_FILES_PER_OWNER" in refused_rpc.details()
    client.files.delete(kept[0].id)  # room for one again
    kept[0] = client.files.create(file=("one-more.jsonl", GOOD), purpose="fine-tune")
    for record in kept:
        client.files.delete(record.id)


def test_with_auth_off_the_files_are_the_client_addresss(reception):
    """A second reception on the same Redis with EXPERT_AUTH=off: no key, so the owner is the client's
    address (as for session limits), and the keys' files stay out of its sight."""
    stack = reception.stack
    port, http_port = free_port(), free_port()
    ports = {"EXPERT_RECEPTION_PORT": str(port), "EXPERT_RECEPTION_HTTP_PORT": str(http_port)}
    stack.start_service("reception", name="reception-open", env={"EXPERT_AUTH": "off", **ports})
    deadline = time.monotonic() + 60
    while health_status(f"127.0.0.1:{port}") != 1:  # SERVING
        assert stack.processes["reception-open"].poll() is None, "the second reception exited"
        assert time.monotonic() < deadline, "the second reception never served"
        time.sleep(0.1)
    try:
        trainer = reception.client(reception.key("keyed", keys_pb2.KEY_SCOPE_TRAIN))
        keyed = trainer.files.create(file=("keyed.jsonl", GOOD), purpose="fine-tune")
        anyone = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="none", max_retries=0)
        mine = anyone.files.create(file=("open.jsonl", GOOD), purpose="fine-tune")
        assert [f.id for f in anyone.files.list()] == [mine.id]
        assert anyone.files.content(mine.id).content == GOOD
        with pytest.raises(openai.NotFoundError):
            anyone.files.retrieve(keyed.id)
        anyone.files.delete(mine.id)
        trainer.files.delete(keyed.id)
    finally:
        stack.stop_service("reception-open")
