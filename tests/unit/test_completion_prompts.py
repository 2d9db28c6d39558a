"""Completions with several prompts and token-id prompts, in process over the fake admission core
of test_http_api.py (tests/e2e/test_openai_api.py runs them with the openai client on a stack)."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from libs.errors import invalid_arguments
from libs.gen.expert.v1 import common_pb2
from services.reception.admission.core import Submitted
from services.reception.http import create_app
from services.reception.job_events import Delta, Finished
from tests.unit.test_http_api import FakeAdmission, FakeCapacity, FakeModels


class PerPrompt(FakeAdmission):
    """Each job answers with its prompt as its choices' text (n of them); a job whose prompt is
    `refused` is refused naming its prompt, as validation does."""

    refused: object = None

    async def infer(self, request):
        self.requests.append(request)
        prompt = request.prompt or list(request.prompt_token_ids)
        if prompt == self.refused:
            raise invalid_arguments([("request.prompt_token_ids[1]", "not a token id")])
        text = str(prompt)
        return common_pb2.InferenceResult(
            job_id=f"j{len(self.requests)}",
            status=common_pb2.JOB_STATUS_COMPLETED,
            choices=[common_pb2.Choice(index=i, text=f"{text}/{i}") for i in range(request.n or 1)],
            metrics=common_pb2.InferenceMetrics(input_tokens=3, output_tokens=2 * (request.n or 1)),
        )

    async def stream(self, request):
        """The job's events: its result's choices, one delta each, then the result."""
        result = await self.infer(request)
        yield Submitted(common_pb2.JobSubmission(job_id=result.job_id, status=common_pb2.JOB_STATUS_QUEUED))
        for choice in result.choices:
            yield Delta(common_pb2.ChoiceDelta(index=choice.index, text=choice.text))
        yield Finished(result)


@pytest.fixture
def parts():
    admission = PerPrompt()
    return admission, TestClient(create_app(admission, FakeCapacity(), FakeModels()))


def test_each_prompt_is_a_job_and_its_choices_are_numbered_prompt_by_prompt(parts):
    admission, http = parts
    body = http.post("/v1/completions", json={"model": "base", "prompt": ["a", [5, 6]], "n": 2}).json()
    assert [(c["index"], c["text"]) for c in body["choices"]] == [
        (0, "a/0"),
        (1, "a/1"),
        (2, "[5, 6]/0"),
        (3, "[5, 6]/1"),
    ]
    assert body["usage"] == {
        "prompt_tokens": 6,
        "completion_tokens": 8,
        "total_tokens": 14,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert body["expert_system"]["job_ids"] == ["j1", "j2"]
    assert [c["index"] for c in body["expert_system"]["validation"]] == [0, 1, 2, 3]
    first, second = admission.requests
    assert (first.prompt, list(first.prompt_token_ids), first.raw) == ("a", [], True)
    assert (second.prompt, list(second.prompt_token_ids), second.raw) == ("", [5, 6], True)


def test_a_refused_prompt_is_named_by_its_place(parts):
    admission, http = parts
    admission.refused = [7, 8]
    error = http.post("/v1/completions", json={"model": "base", "prompt": [[1], [7, 8]]}).json()["error"]
    assert error["param"] == "prompt[1][1]" and error["message"] == "prompt[1][1]: not a token id"
    one = http.post("/v1/completions", json={"model": "base", "prompt": [7, 8]}).json()["error"]
    assert one["param"] == "prompt[1]"  # one prompt of token ids: its id's place


@pytest.mark.parametrize(
    "prompt, stream, param",
    [
        ([], False, "prompt"),
        ([[1], []], False, "prompt[1]"),
        ([1, -2], False, "prompt[1]"),
        ([[1], [2, True]], False, "prompt[1][1]"),
        ([[1], {"a": 1}], False, "prompt[1]"),
        (["a"] * 17, False, "prompt"),
        (["a"] * 17, True, "prompt"),
    ],
)
def test_a_bad_prompt_list_is_refused_naming_the_item(parts, prompt, stream, param):
    _, http = parts
    answer = http.post("/v1/completions", json={"model": "base", "prompt": prompt, "stream": stream})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text


def _events(answer) -> list:
    return [json.loads(line[6:]) for line in answer.text.splitlines() if line.startswith("data: {")]


def test_several_prompts_stream_interleaved_each_choice_by_its_index(parts):
    admission, http = parts
    body = {
        "model": "base",
        "prompt": ["a", [5, 6]],
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    answer = http.post("/v1/completions", json=body)
    assert answer.status_code == 200 and answer.text.endswith("data: [DONE]\n\n"), answer.text
    events = _events(answer)
    texts = {c["index"]: c["text"] for e in events for c in e["choices"] if c["text"]}
    assert texts == {0: "a/0", 1: "a/1", 2: "[5, 6]/0", 3: "[5, 6]/1"}
    finishes = sorted(c["index"] for e in events for c in e["choices"] if c["finish_reason"])
    assert finishes == [0, 1, 2, 3]
    assert {e["id"] for e in events} == {"cmpl-j1"}
    *chunks, last = events
    assert last["choices"] == [] and last["usage"]["total_tokens"] == 14
    assert all(e["usage"] is None for e in chunks)
    admission.refused = [7, 8]
    refused = http.post("/v1/completions", json={**body, "prompt": [[1], [7, 8]]})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt[1][1]"
