"""OpenAI's Responses API (`/v1/responses`, docs/api.md#the-responses-api) against a real stack on
the default model, through the official `openai` client: string and message input, instructions,
`text.format` json_schema, the streamed events in order, chains of stored responses as sessions
(one session per chain whose engine keeps its KV, a branch forking a new one, a continuation
outliving its session, `store: false` opening none, a full engine answering with a plain job),
`responses.retrieve`/`delete`, refusals that name the field, function tools (forced calls,
streamed arguments, the tool's result continuing the call's session) and the OpenAI Agents SDK
running an agent with one function tool, its tool loop one session when chained by response ids."""

from __future__ import annotations

import asyncio
import json

import grpc
import jsonschema
import openai
import pytest

from libs.gen.expert.v1 import session_pb2, session_pb2_grpc
from libs.structured_output import StructuredOutput, text_problem
from tests.e2e.conftest import openai_client, stack_env, wait_ready
from tools.stack import LocalStack

ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}


# Sessions the engine keeps: room for this module's chains and tool turns (about 15 sessions),
# few enough to fill (the last test).
MAX_SESSIONS = 20


@pytest.fixture(scope="module")
def stack(default_model, tmp_path_factory) -> LocalStack:
    """The default model: its forced tool calls end (a tiny random model's may run to max_tokens)."""
    env = stack_env(
        default_model,
        EXPERT_MAX_MODEL_LEN="2048",
        EXPERT_KV_NUM_BLOCKS="256",
        EXPERT_MAX_NUM_SEQS="2",
        EXPERT_MAX_SESSIONS=str(MAX_SESSIONS),
    )
    stack = LocalStack.on_free_ports(tmp_path_factory.mktemp("responses-stack"), env=env)
    stack.start()
    try:
        wait_ready(stack)
        yield stack
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    with openai_client(stack) as client:
        yield client


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def test_string_input_answers_one_message_with_usage_and_is_stored(client, model):
    response = client.responses.create(
        model=model, input="Name a colour.", max_output_tokens=6, temperature=0.0
    )
    assert response.id.startswith("resp_") and response.object == "response" and response.model == model
    assert response.status in ("completed", "incomplete")
    if response.status == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens"
    (item,) = response.output
    assert item.type == "message" and item.role == "assistant"
    assert response.output_text == item.content[0].text and item.content[0].type == "output_text"
    usage = response.usage
    assert usage.input_tokens > 0 and 0 < usage.output_tokens <= 6
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    stored = client.responses.retrieve(response.id)
    assert stored.model_dump() == response.model_dump()


def test_messages_with_instructions_answer_as_the_same_chat_does(client, model):
    conversation = [
        {"role": "user", "content": [{"type": "input_text", "text": "Hello"}]},
        {"role": "assistant", "content": "Hi! How can I help?"},
        {"role": "user", "content": "Say something short."},
    ]
    response = client.responses.create(
        model=model, instructions="Be brief.", input=conversation, max_output_tokens=8, temperature=0.0
    )
    chat = client.chat.completions.create(
        model=model,
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": "Hi! How can I help?"},
            {"role": "user", "content": "Say something short."},
        ],
        max_completion_tokens=8,
        temperature=0.0,
    )
    assert response.instructions == "Be brief."
    assert response.output_text == chat.choices[0].message.content  # one code path, greedy: one answer
    assert response.usage.input_tokens == chat.usage.prompt_tokens


def test_json_schema_text_format_is_enforced(client, model):
    response = client.responses.create(
        model=model,
        input="Is Paris in France?",
        max_output_tokens=32,
        temperature=0.0,
        text={"format": {"type": "json_schema", "name": "answer", "schema": ANSWER_SCHEMA, "strict": True}},
    )
    assert response.text.format.type == "json_schema"
    output_format = StructuredOutput("json_schema", json.dumps(ANSWER_SCHEMA))
    if response.status == "incomplete":  # the model's whitespace ran to max_output_tokens
        assert text_problem(output_format, response.output_text) == "ends before the format is complete"
        return
    assert response.status == "completed", response.output_text
    jsonschema.validate(json.loads(response.output_text), ANSWER_SCHEMA)


def test_stream_events_come_in_order_and_add_up_to_the_stored_response(client, model):
    events = list(
        client.responses.create(
            model=model, input="Count to three.", max_output_tokens=10, temperature=0.0, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert deltas, kinds
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[4 : 4 + len(deltas)] == ["response.output_text.delta"] * len(deltas)
    assert kinds[4 + len(deltas) :][:3] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert kinds[-1] in ("response.completed", "response.incomplete") and len(kinds) == len(deltas) + 8
    text = "".join(d.delta for d in deltas)
    final = events[-1].response
    assert events[-4].text == text and final.output_text == text and final.usage.output_tokens <= 10
    assert events[0].response.status == "in_progress" and events[0].response.id == final.id
    assert client.responses.retrieve(final.id).output_text == text


ADA = "My name is Ada and I live in a small town by the sea."
NAME = "What is my name?"


@pytest.fixture(scope="module")
def sessions(stack) -> session_pb2_grpc.SessionServiceStub:
    """The stack's SessionService, where the chains of stored responses are sessions."""
    with grpc.insecure_channel(stack.target("reception")) as channel:
        yield session_pb2_grpc.SessionServiceStub(channel)


def _link(response) -> tuple[str, int] | None:
    """The session and turn a response names (None: answered as a plain job)."""
    extra = response.model_extra.get("expert_system") or {}
    return (extra["session_id"], extra["session_turn"]) if "session_id" in extra else None


def _session(sessions, session_id: str) -> session_pb2.Session:
    return sessions.GetSession(session_pb2.GetSessionRequest(session_id=session_id)).session


@pytest.fixture(scope="module")
def chain(client, model):
    """Three stored responses, each continuing the one before (the last one streamed)."""
    first = client.responses.create(model=model, input=ADA, max_output_tokens=5, temperature=0.0)
    second = client.responses.create(
        model=model, previous_response_id=first.id, input=NAME, max_output_tokens=5, temperature=0.0
    )
    events = list(
        client.responses.create(
            model=model, previous_response_id=second.id, input="Thanks.", max_output_tokens=3, stream=True
        )
    )
    return first, second, events[-1].response


def test_a_chain_of_responses_is_one_session_whose_kv_the_engine_keeps(chain, sessions):
    first, second, third = chain
    session_id, _ = _link(first)
    assert [_link(r) for r in chain] == [(session_id, 1), (session_id, 2), (session_id, 3)]
    assert third.previous_response_id == second.id
    session = _session(sessions, session_id)
    assert session.turns == 3 and session.state == session_pb2.SESSION_STATE_IDLE
    # The second turn computes only its new message: the first turn's prompt and reply are the KV
    # the engine kept (all but the reply's last token, which was sampled and never run).
    history = first.usage.input_tokens + first.usage.output_tokens
    cached = second.usage.input_tokens_details.cached_tokens
    assert history - 1 <= cached < second.usage.input_tokens
    assert session.tokens == third.usage.input_tokens + third.usage.output_tokens


def test_a_stored_chain_answers_as_the_same_chat_does(chain, client, model):
    first, second, third = chain
    chat = client.chat.completions.create(
        model=model,
        messages=[
            {"role": "user", "content": ADA},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": NAME},
        ],
        max_completion_tokens=5,
        temperature=0.0,
    )
    assert second.usage.input_tokens == chat.usage.prompt_tokens > first.usage.input_tokens
    assert second.output_text == chat.choices[0].message.content
    assert client.responses.retrieve(third.id).model_dump() == third.model_dump()


def test_a_branch_from_an_older_response_forks_a_new_session(chain, client, model, sessions):
    first, second, _ = chain
    branch = client.responses.create(
        model=model, previous_response_id=first.id, input=NAME, max_output_tokens=5, temperature=0.0
    )
    # A new session holding the first exchange and the branch's input: the same conversation as
    # the chain's second turn, so the same answer; the chain's session is left as it was.
    assert _link(branch)[0] != _link(first)[0] and _link(branch)[1] == 1
    assert branch.output_text == second.output_text
    assert branch.usage.input_tokens == second.usage.input_tokens
    assert _session(sessions, _link(first)[0]).turns == 3


def test_store_false_opens_no_session_and_stores_nothing(chain, client, model, sessions):
    first, second, _ = chain
    unstored = client.responses.create(
        model=model, previous_response_id=second.id, input="Thanks.", max_output_tokens=3, store=False
    )
    assert _link(unstored) is None
    assert _session(sessions, _link(first)[0]).turns == 3  # the chain's session took nothing of it
    assert unstored.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens
    with pytest.raises(openai.NotFoundError) as raised:  # store=False: nothing to continue from
        client.responses.create(
            model=model, previous_response_id=unstored.id, input="Again.", max_output_tokens=3
        )
    assert raised.value.body["param"] == "previous_response_id"
    assert raised.value.body["code"] == "previous_response_not_found"


def test_a_continuation_outlives_its_session(chain, client, model, sessions):
    _, _, third = chain
    session_id, _ = _link(third)
    sessions.EndSession(session_pb2.EndSessionRequest(session_id=session_id))  # as if it expired
    later = client.responses.create(
        model=model, previous_response_id=third.id, input="Bye.", max_output_tokens=3
    )
    # The stored conversation seeds a new session: its first turn computes the whole of it.
    assert _link(later)[0] != session_id and _link(later)[1] == 1
    assert later.usage.input_tokens > third.usage.input_tokens + third.usage.output_tokens


def test_an_unknown_previous_response_is_not_found(client, model):
    with pytest.raises(openai.NotFoundError) as raised:
        client.responses.create(
            model=model, previous_response_id="resp_" + "0" * 32, input="Hi", max_output_tokens=3
        )
    assert raised.value.body["param"] == "previous_response_id"
    assert raised.value.body["code"] == "previous_response_not_found"


def test_a_deleted_response_is_gone(client, model):
    response = client.responses.create(model=model, input="Hi", max_output_tokens=2)
    deleted = client.responses.delete(response.id)
    assert deleted is None  # the client returns nothing for a delete
    with pytest.raises(openai.NotFoundError) as raised:
        client.responses.retrieve(response.id)
    assert raised.value.body["code"] == "not_found"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"bogus": 1}, "bogus"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"max_output_tokens": 100_000}, "max_output_tokens"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"text": {"format": {"type": "json_schema", "schema": ANSWER_SCHEMA}}}, "text.format.name"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0]",
        ),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
        ({"background": True}, "background"),
        ({"temperature": -1}, "temperature"),
    ],
)
def test_refusals_name_the_field(client, model, fields, param):
    body = {"model": model, "input": "Hi", "max_output_tokens": 4} | fields
    with pytest.raises(openai.BadRequestError) as raised:
        client.post("/responses", body=body, cast_to=object)
    error = raised.value.body
    assert error["param"] == param, error
    assert error["code"] and error["type"] == "invalid_request_error"


def _run_agent(stack: LocalStack, agent_for, prompt: str, chained: bool = False):
    """Run the agent `agent_for(model)` makes on `prompt` with the OpenAI Agents SDK, its model our
    `/v1/responses` (tracing off: nothing leaves the machine); `chained`: each model call continues
    the last by `previous_response_id` (the SDK's `auto_previous_response_id`)."""
    from agents import OpenAIResponsesModel, RunConfig, Runner

    async def run():
        async with openai.AsyncOpenAI(
            base_url=stack.http_url() + "/v1", api_key="unused", max_retries=0
        ) as client:
            model = (await client.models.list()).data[0].id
            agent = agent_for(OpenAIResponsesModel(model=model, openai_client=client))
            return await Runner.run(
                agent,
                prompt,
                max_turns=3,
                run_config=RunConfig(tracing_disabled=True),
                auto_previous_response_id=chained,
            )

    return asyncio.run(run())


def test_an_agents_sdk_agent_answers_through_the_responses_api(stack, client, model):
    from agents import Agent, ModelSettings

    settings = ModelSettings(max_tokens=64, temperature=0.0)
    result = _run_agent(
        stack,
        lambda m: Agent(name="helper", instructions="Be brief.", model=m, model_settings=settings),
        "Hello",
    )
    direct = client.responses.create(
        model=model, instructions="Be brief.", input="Hello", max_output_tokens=64, temperature=0.0
    )
    assert result.final_output == direct.output_text  # greedy: the same answer, whoever asks


# -- function tools (chat completions' tool calling, through the same path) ----------------------

CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Lyon"]}}, "required": ["city"]}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": CITY,
}


def test_a_streamed_call_sends_its_arguments_as_deltas(client, model):
    events = list(
        client.responses.create(
            model=model,
            input="Weather in Lyon?",
            tools=[WEATHER],
            tool_choice={"type": "function", "name": "get_weather"},
            max_output_tokens=48,
            temperature=0.0,
            stream=True,
        )
    )
    assert [e.sequence_number for e in events] == list(range(len(events)))
    added = [e for e in events if e.type == "response.output_item.added"]
    assert added and added[0].item.type == "function_call" and added[0].item.name == "get_weather"
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(pieces) > 1  # the arguments come as they are generated, not at the end
    arguments = "".join(pieces)
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.arguments == arguments and jsonschema.validate(json.loads(arguments), CITY) is None
    final = events[-1]
    assert final.type == "response.completed" and final.response.output[0].arguments == arguments


def test_the_tool_s_result_continues_the_conversation_s_session(client, model, sessions):
    first = client.responses.create(
        model=model, input="Weather in Paris?", tools=[WEATHER], tool_choice="required", max_output_tokens=48
    )
    assert first.status == "completed", first.output
    call = next(item for item in first.output if item.type == "function_call")
    assert call.name == "get_weather" and jsonschema.validate(json.loads(call.arguments), CITY) is None
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}
    follow_up = client.responses.create(
        model=model,
        previous_response_id=first.id,
        input=[result],
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=8,
        temperature=0.0,
    )
    assert [item.type for item in follow_up.output] == ["message"]
    assert follow_up.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    # The call and its result are one session: the result is the turn after the call's, and the
    # engine computes only it (the call's turn, its tool listing included, is the KV it kept).
    session_id, _ = _link(first)
    assert [_link(first), _link(follow_up)] == [(session_id, 1), (session_id, 2)]
    assert _session(sessions, session_id).turns == 2
    history = first.usage.input_tokens + first.usage.output_tokens
    assert history - 1 <= follow_up.usage.input_tokens_details.cached_tokens < follow_up.usage.input_tokens
    # The same turn replayed in full (as the Agents SDK sends it unchained) opens a session of its
    # own, whose first turn renders the call from its text as a chat completion does, and answers as
    # that chat completion (the chain's session holds the model's own tokens of the call instead,
    # e.g. its indented arguments, so its answer may differ).
    replayed = client.responses.create(
        model=model,
        input=[{"role": "user", "content": "Weather in Paris?"}, call.model_dump(exclude_none=True), result],
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=8,
        temperature=0.0,
    )
    assert _link(replayed)[0] != session_id and _link(replayed)[1] == 1
    chat = client.chat.completions.create(
        model=model,
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call.call_id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C"},
        ],
        tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}],
        tool_choice="none",
        max_completion_tokens=8,
        temperature=0.0,
    )
    assert replayed.output_text == chat.choices[0].message.content
    assert replayed.usage.input_tokens == chat.usage.prompt_tokens


def test_an_agents_sdk_agent_calls_its_function_tool(stack):
    from agents import Agent, ModelSettings, function_tool

    cities: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        cities.append(city)
        return f"Sunny in {city}"

    settings = ModelSettings(tool_choice="required", max_tokens=48, temperature=0.0)
    result = _run_agent(
        stack,
        lambda m: Agent(
            name="forecaster",
            instructions="Use the tool.",
            model=m,
            model_settings=settings,
            tools=[get_weather],
            tool_use_behavior="stop_on_first_tool",
        ),
        "What is the weather in Paris?",
    )
    assert cities and result.final_output == f"Sunny in {cities[0]}"


def test_an_agents_sdk_tool_loop_chained_by_response_ids_is_one_session(stack, client, sessions):
    """The agent calls its tool and runs the model again on the result: at least two model calls,
    each after the first sending only what is new (`previous_response_id`), all turns of one
    session."""
    from agents import Agent, ModelSettings, ToolsToFinalOutputResult, function_tool

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"Sunny in {city}"

    calls = []

    def stop_after_two_calls(context, results) -> ToolsToFinalOutputResult:
        # After the first call the model runs again under `auto` (the SDK drops `required` once a
        # tool ran), where the small model calls again: its second call's result ends the run.
        calls.extend(results)
        return ToolsToFinalOutputResult(len(calls) >= 2, results[-1].output if len(calls) >= 2 else None)

    settings = ModelSettings(tool_choice="required", max_tokens=48, temperature=0.0)
    result = _run_agent(
        stack,
        lambda m: Agent(
            name="forecaster",
            instructions="Use the tool.",
            model=m,
            model_settings=settings,
            tools=[get_weather],
            tool_use_behavior=stop_after_two_calls,
        ),
        "What is the weather in Paris?",
        chained=True,
    )
    links = [_link(client.responses.retrieve(r.response_id)) for r in result.raw_responses]
    assert len(links) >= 2 and links[0] is not None, links
    session_id = links[0][0]
    assert links == [(session_id, turn) for turn in range(1, len(links) + 1)]
    assert _session(sessions, session_id).turns == len(links)


# -- last: it fills the engine's table of sessions, which the tests above need room in ---------


def test_a_response_the_engine_has_no_session_room_for_runs_as_a_plain_job(client, model):
    """Every stored response opens a session until the engine's table (EXPERT_MAX_SESSIONS) is full;
    then the engine refuses the turn, and the response is answered as a plain job, as it would be
    with `store: false`, and stored (its conversation continues it later)."""
    for _ in range(MAX_SESSIONS + 1):
        response = client.responses.create(model=model, input="Hi", max_output_tokens=1)
        if _link(response) is None:
            break
    assert _link(response) is None and response.status in ("completed", "incomplete")
    assert client.responses.retrieve(response.id).output_text == response.output_text
    events = list(client.responses.create(model=model, input="Hi", max_output_tokens=1, stream=True))
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert client.responses.retrieve(events[-1].response.id).output_text == events[-1].response.output_text
