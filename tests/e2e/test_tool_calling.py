"""Tool calling (docs/api.md#tool-calling) against a real stack on the default model, with the real
`openai` client and `langchain-openai`: required, named and auto calls, text under auto, calls
streamed as they are generated (OpenAI's deltas, gRPC's structured deltas, LangChain's
streaming), a follow-up turn with the tool's result, a replayed history with `name`,
`tool_calls` and `tool_call_id`, the refusals that name their part, and the validity of 50 of our
prompts' required and named calls (each parses and validates against its function's schema)."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import langchain_core.messages as langchain_messages
import langchain_core.tools as langchain_tools
import langchain_openai
import openai
import pydantic
import pytest

from expert_system import ExpertClient, InvalidRequest
from tests.e2e.conftest import openai_client, stack_env, wait_ready
from tools.stack import LocalStack

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
ADD = {
    "type": "object",
    # bounded, so that a call always fits max_tokens (a small model may write digits without end)
    "properties": {
        "a": {"type": "integer", "minimum": -1000000, "maximum": 1000000},
        "b": {"type": "integer", "minimum": -1000000, "maximum": 1000000},
    },
    "required": ["a", "b"],
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": WEATHER,
        },
    },
    {
        "type": "function",
        "function": {"name": "add", "description": "The sum of two integers", "parameters": ADD},
    },
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
MAX_TOKENS = 80


@pytest.fixture(scope="module")
def stack(default_model, tmp_path_factory) -> LocalStack:
    """The default model, with room for 8 sequences at once (the validity run is batched)."""
    env = stack_env(
        default_model, EXPERT_MAX_MODEL_LEN="2048", EXPERT_KV_NUM_BLOCKS="512", EXPERT_MAX_NUM_SEQS="8"
    )
    stack = LocalStack.on_free_ports(tmp_path_factory.mktemp("tool-stack"), env=env)
    stack.start()
    wait_ready(stack)
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def oai(stack) -> openai.OpenAI:
    # A generous timeout: the validity run queues 50 requests behind 8 engine slots, and each
    # request's time includes its wait.
    return openai_client(stack).with_options(timeout=1800)


def chat(oai: openai.OpenAI, content: str, **fields):
    fields = {"temperature": 0.0, "max_tokens": MAX_TOKENS, **fields}
    return oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], tools=TOOLS, **fields
    )


@pytest.fixture(scope="module")
def greedy(oai):
    """A non-streamed greedy answer, asked once per module: several tests read the same one (each
    generation costs seconds on a busy machine)."""
    answers = {}

    def answer(content: str, **fields):
        key = (content, json.dumps(fields, sort_keys=True))
        if key not in answers:
            answers[key] = chat(oai, content, **fields)
        return answers[key]

    return answer


def assert_valid_calls(message, names=SCHEMAS) -> None:
    assert message.content is None
    assert message.tool_calls
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_makes_a_valid_call(greedy):
    answer = greedy("What is the weather in Paris?", tool_choice="required", parallel_tool_calls=False)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert_valid_calls(choice.message)
    assert len(choice.message.tool_calls) == 1


def test_a_named_function_is_the_one_called(oai):
    answer = chat(oai, "What is 2 plus 3?", tool_choice={"type": "function", "function": {"name": "add"}})
    assert answer.choices[0].finish_reason == "tool_calls"
    assert_valid_calls(answer.choices[0].message, names={"add"})


def test_auto_chooses_a_call_where_one_is_needed(greedy):
    # The default model (135M parameters) rarely calls under auto (bench/tool_choice_auto.py); a
    # prompt that starts the call for it does, greedily.
    answer = greedy("<tool_call> get_weather for Paris", tool_choice="auto", parallel_tool_calls=False)
    assert answer.choices[0].finish_reason == "tool_calls", answer.choices[0].message
    assert_valid_calls(answer.choices[0].message)


def test_auto_answers_with_text_where_no_call_is_needed(oai):
    answer = chat(oai, "Say hello to me.")  # tool_choice defaults to auto with tools
    choice = answer.choices[0]
    assert choice.finish_reason in ("stop", "length")
    assert choice.message.tool_calls is None and choice.message.content


def streamed_calls(stream) -> tuple[dict[int, dict], str | None, str]:
    """A streamed chat's calls (id, name, arguments and how many argument pieces), its finish
    reason and its content, put together from OpenAI's deltas."""
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"arguments": "", "pieces": 0})
                if delta.id:  # the first delta of a call names it
                    assert "name" not in call and delta.type == "function"
                    call.update(id=delta.id, name=delta.function.name)
                if delta.function.arguments:
                    call["arguments"] += delta.function.arguments
                    call["pieces"] += 1
    return calls, finish, content


@pytest.mark.parametrize(
    ("prompt", "tool_choice"),
    [("What is the weather in Paris?", "required"), ("<tool_call> get_weather for Paris", "auto")],
)
def test_streamed_calls_come_as_they_are_generated_and_match_the_unstreamed_call(
    oai, greedy, prompt, tool_choice
):
    fields = {"tool_choice": tool_choice, "parallel_tool_calls": False}
    calls, finish, content = streamed_calls(chat(oai, prompt, stream=True, **fields))
    assert finish == "tool_calls" and len(calls) == 1, calls
    assert content == ""  # nothing of the call's markup is content
    [call] = calls.values()
    assert call["id"].startswith("call_") and call["pieces"] > 1  # the arguments come as generated
    jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    # Greedy: the same call as the unstreamed answer, arguments character for character.
    [whole] = greedy(prompt, **fields).choices[0].message.tool_calls
    assert (call["name"], call["arguments"]) == (whole.function.name, whole.function.arguments)


def test_a_streamed_text_answer_is_content(oai):
    stream = chat(oai, "Say hello to me.", stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text and "<tool_call>" not in text


def test_the_tools_result_is_answered_in_a_follow_up_turn(oai, greedy):
    first = greedy("What is the weather in Paris?", tool_choice="required", parallel_tool_calls=False)
    call = first.choices[0].message.tool_calls[0]
    history = [
        {"role": "user", "content": "What is the weather in Paris?", "name": "ann"},
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "21 degrees and sunny"},
    ]
    answer = oai.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, tool_choice="none", temperature=0.0, max_tokens=MAX_TOKENS
    )
    assert answer.choices[0].message.tool_calls is None
    assert answer.choices[0].message.content


def test_a_replayed_history_with_names_calls_and_results_is_accepted(oai):
    history = [
        {"role": "system", "content": "You are terse.", "name": "policy"},
        {"role": "user", "content": "Add 2 and 3.", "name": "ann"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_abc",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_abc", "content": "5"},
        {"role": "assistant", "content": "The sum is 5."},
        {"role": "user", "content": "And 4 plus 4?", "name": "ann"},
    ]
    answer = oai.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, tool_choice="required", max_tokens=MAX_TOKENS
    )
    assert_valid_calls(answer.choices[0].message)


def test_grpc_and_the_sdk_carry_tools_and_calls(stack):
    with ExpertClient(stack.target("reception")) as client:
        result = client.infer(
            "What is 2 plus 3?",
            tools=TOOLS,
            tool_choice="add",
            parallel_tool_calls=False,
            temperature=0.0,
            max_tokens=MAX_TOKENS,
        )
        choice = result.choices[0]
        assert choice.finish_reason == "tool_calls" and len(choice.tool_calls) == 1
        call = choice.tool_calls[0]
        assert call.name == "add" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.arguments), ADD)
        with pytest.raises(InvalidRequest) as refused:
            client.infer("Hi", tools=TOOLS, tool_choice="nope")
        assert [f for f, _ in refused.value.field_violations] == ["request.tool_choice.function"]


def test_grpc_streams_calls_as_structured_deltas_without_markup(stack):
    with ExpertClient(stack.target("reception")) as client:
        stream = client.infer_stream(
            "What is 2 plus 3?",
            tools=TOOLS,
            tool_choice="add",
            parallel_tool_calls=False,
            temperature=0.0,
            max_tokens=MAX_TOKENS,
        )
        chunks = list(stream)
    assert "".join(c.text for c in chunks) == ""  # a call is never text
    deltas = [d for c in chunks for d in c.tool_calls]
    [call] = stream.result.choices[0].tool_calls
    assert (deltas[0].index, deltas[0].id, deltas[0].name) == (0, call.id, "add")
    pieces = [d.arguments for d in deltas[1:]]
    assert len(pieces) > 1 and "".join(pieces) == call.arguments
    jsonschema.validate(json.loads(call.arguments), ADD)


def test_langchain_streams_a_bound_tool_s_call(llm):
    caller = llm.bind_tools([add, get_weather], tool_choice="required", parallel_tool_calls=False)
    chunks = list(caller.stream("What is 2 plus 3?"))
    assert sum(1 for c in chunks if c.tool_call_chunks) > 2  # the call comes in pieces
    message = chunks[0]
    for chunk in chunks[1:]:
        message += chunk
    [call] = message.tool_calls
    assert call["id"].startswith("call_") and not message.content
    {"add": add, "get_weather": get_weather}[call["name"]].args_schema.model_validate(call["args"])


def test_empty_tools_are_no_tools(oai):
    answer = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], tools=[], max_tokens=8
    )
    assert answer.choices[0].message.tool_calls is None


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
            "tools[0].function.parameters",
        ),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "functions": [{"name": "f"}]}, "functions"),
        ({"tools": TOOLS, "function_call": "auto"}, "function_call"),
        ({"functions": [{"name": "bad name!"}]}, "functions[0].name"),
        ({"functions": [{"name": "f"}], "function_call": {"name": "g"}}, "function_call.name"),
        ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
    ],
)
def test_bad_tools_are_refused_naming_the_part(stack, fields, param):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **fields}
    answer = httpx.post(stack.http_url() + "/v1/chat/completions", json=body, timeout=30)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and error["code"], error


# 50 requests of ours: 25 prompts, each with tool_choice required and with its function named.
VALIDITY_PROMPTS = [
    *(
        f"What is the weather in {city}?"
        for city in ("Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Delhi", "Quito", "Perth")
    ),
    *(f"Is it raining in {city} today?" for city in ("Rome", "Berlin", "Madrid", "Seoul")),
    *(f"What is {a} plus {b}?" for a, b in ((2, 3), (10, 32), (7, 8), (100, 1), (-4, 9), (0, 0))),
    *(f"Add {a} and {b} for me." for a, b in ((5, 5), (12, 30), (99, 1))),
    "I need the temperature in Nairobi in fahrenheit.",
    "Sum up 17 and 25.",
    "Tell me a joke.",
    "Hello there!",
]


def _one_call(oai: openai.OpenAI, prompt: str, tool_choice) -> tuple[str, bool]:
    answer = chat(oai, prompt, tool_choice=tool_choice, temperature=0.7, parallel_tool_calls=False)
    message = answer.choices[0].message
    try:
        names = {tool_choice["function"]["name"]} if isinstance(tool_choice, dict) else set(SCHEMAS)
        assert_valid_calls(message, names)
        return prompt, answer.choices[0].finish_reason == "tool_calls"
    except (AssertionError, jsonschema.ValidationError, json.JSONDecodeError, TypeError):
        return prompt, False


@pytest.mark.timeout(1500)  # 50 generations: minutes on a busy 2-core machine
def test_required_and_named_calls_always_parse_and_validate(oai):
    named = [{"type": "function", "function": {"name": "add" if i % 2 else "get_weather"}} for i in range(25)]
    requests = [(p, "required") for p in VALIDITY_PROMPTS] + list(zip(VALIDITY_PROMPTS, named, strict=True))
    assert len(requests) == 50
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(lambda r: _one_call(oai, *r), requests))
    failed = [prompt for prompt, ok in results if not ok]
    assert not failed, failed


# LangChain's OpenAI chat model (langchain-openai) on the same stack: its tool binding, its
# structured output by function calling, and an agent loop of two calls, each result fed back.


@pytest.fixture(scope="module")
def llm(stack):
    return langchain_openai.ChatOpenAI(
        base_url=stack.http_url() + "/v1",
        api_key="unused",
        model=MODEL,
        temperature=0.0,
        max_tokens=MAX_TOKENS,
        max_retries=0,
        timeout=1800,
    )


class AddArguments(pydantic.BaseModel):
    # bounded, so that a call always fits max_tokens
    a: int = pydantic.Field(ge=-1000000, le=1000000)
    b: int = pydantic.Field(ge=-1000000, le=1000000)


@langchain_tools.tool(args_schema=AddArguments)
def add(a: int, b: int) -> int:
    """The sum of two integers."""
    return a + b


@langchain_tools.tool
def get_weather(city: str) -> str:
    """The current weather in a city."""
    return f"21 degrees and sunny in {city}"


class Forecast(pydantic.BaseModel):
    """A weather forecast for a city."""

    city: str = pydantic.Field(max_length=40)
    degrees: int = pydantic.Field(ge=-100, le=100)


def test_langchain_bind_tools_invoke_returns_a_tool_call(llm):
    message = llm.bind_tools([add, get_weather], tool_choice="required", parallel_tool_calls=False).invoke(
        "What is 2 plus 3?"
    )
    assert message.tool_calls, message
    call = message.tool_calls[0]
    assert call["name"] in ("add", "get_weather") and call["id"].startswith("call_")
    tool = {"add": add, "get_weather": get_weather}[call["name"]]
    tool.args_schema.model_validate(call["args"])


def test_langchain_structured_output_by_function_calling(llm):
    forecast = llm.with_structured_output(Forecast, method="function_calling").invoke("Forecast for Paris?")
    assert isinstance(forecast, Forecast)


def test_langchain_agent_loop_of_two_tool_calls(llm):
    tools = {"add": add, "get_weather": get_weather}
    caller = llm.bind_tools(list(tools.values()), tool_choice="required", parallel_tool_calls=False)
    messages = [langchain_messages.HumanMessage("Add 2 and 3, then add 10 to the result.")]
    for _ in range(2):
        reply = caller.invoke(messages)
        assert reply.tool_calls, reply
        messages.append(reply)
        for call in reply.tool_calls:
            messages.append(tools[call["name"]].invoke(call))  # a ToolMessage with the call's id
    final = llm.bind_tools(list(tools.values()), tool_choice="none").invoke(messages)
    assert not final.tool_calls and final.content
    assert sum(isinstance(m, langchain_messages.ToolMessage) for m in messages) >= 2


def test_the_deprecated_functions_form_calls_and_takes_its_result(oai):
    functions = [tool["function"] for tool in TOOLS]
    question = {"role": "user", "content": "What is 2 plus 3?"}
    first = oai.chat.completions.create(
        model=MODEL,
        messages=[question],
        functions=functions,
        function_call={"name": "add"},
        temperature=0.0,
        max_tokens=MAX_TOKENS,
    )
    choice = first.choices[0]
    assert choice.finish_reason == "function_call" and choice.message.tool_calls is None
    call = choice.message.function_call
    assert call.name == "add" and choice.message.content is None
    jsonschema.validate(json.loads(call.arguments), ADD)
    history = [
        question,
        {"role": "assistant", "content": None, "function_call": {"name": "add", "arguments": call.arguments}},
        {"role": "function", "name": "add", "content": "5"},
    ]
    answer = oai.chat.completions.create(
        model=MODEL, messages=history, functions=functions, function_call="none", max_tokens=8
    )
    assert answer.choices[0].message.function_call is None and answer.choices[0].message.content


def _turn(session, input, **fields):
    session.append(input)
    stream = session.generate(**fields)
    text = "".join(chunk.text for chunk in stream)
    assert stream.end is not None and text == stream.end.text
    return stream.end


def test_a_session_turn_calls_a_tool_and_answers_its_result(stack):
    with (
        ExpertClient(stack.target("reception")) as client,
        client.session(temperature=0.0, max_new_tokens=MAX_TOKENS) as session,
    ):
        question = "What is the weather in Paris?"
        first = _turn(session, question, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
        assert first.finish_reason == "tool_calls" and len(first.tool_calls) == 1, first
        call = first.tool_calls[0]
        assert call.name in SCHEMAS and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        # The result goes back as a tool message; the same tools under none get a text answer.
        result = {"role": "tool", "tool_call_id": call.id, "content": "21 degrees and sunny"}
        second = _turn(session, [result], tools=TOOLS, tool_choice="none", max_new_tokens=8)
        assert second.finish_reason in ("stop", "length") and not second.tool_calls and second.text
        assert second.session.turns == 2
        session.append("And what is 2 plus 3?")
        with pytest.raises(InvalidRequest) as refused:
            list(session.generate(tools=TOOLS, tool_choice="nope"))
        assert [f for f, _ in refused.value.field_violations] == ["tool_choice.function"]


def test_the_rest_api_takes_tools_and_returns_calls(stack):
    body = {
        "prompt": "What is 2 plus 3?",
        "tools": [{"name": "add", "description": "The sum of two integers", "parameters": ADD}],
        "tool_choice": {"function": "add"},
        "parallel_tool_calls": False,
        "temperature": 0.0,
        "max_tokens": MAX_TOKENS,
    }
    answer = httpx.post(stack.http_url() + "/v1/infer", json=body, timeout=600)
    assert answer.status_code == 200, answer.text
    result = answer.json()
    assert result["finish_reason"] == "tool_calls"
    [call] = result["choices"][0]["tool_calls"]
    assert call["name"] == "add" and call["id"].startswith("call_") and call["type"] == "function"
    jsonschema.validate(json.loads(call["arguments"]), ADD)
    refused = httpx.post(stack.http_url() + "/v1/infer", json={**body, "tool_choice": "nope"}, timeout=30)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tool_choice", refused.text
    unknown = httpx.post(
        stack.http_url() + "/v1/infer", json={**body, "tool_choice": {"function": "sub"}}, timeout=30
    )
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "tool_choice.function"


def _expertctl(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tools.expertctl.main", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_expertctl_takes_tools_from_a_file_and_prints_the_calls(stack, tmp_path):
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(TOOLS))
    target = ["--target", stack.target("reception")]
    options = [
        "--tools",
        str(tools),
        "--tool-choice",
        "add",
        "--no-parallel-tool-calls",
        "--temperature",
        "0",
        "--max-tokens",
        str(MAX_TOKENS),
    ]
    infer = _expertctl("infer", "What is 2 plus 3?", *options, "--json", *target)
    assert infer.returncode == 0, infer.stderr
    [choice] = json.loads(infer.stdout)["choices"]
    assert choice["finish_reason"] == "tool_calls" and [c["name"] for c in choice["tool_calls"]] == ["add"]
    jsonschema.validate(json.loads(choice["tool_calls"][0]["arguments"]), ADD)
    # chat: the reply's call is printed, /result answers it, and the model (made to call add) calls again.
    chat = _expertctl("chat", *options, *target, stdin="What is 2 plus 3?\n/result 5\n")
    assert chat.returncode == 0 and "Traceback" not in chat.stderr, chat.stderr
    calls = [line for line in chat.stdout.splitlines() if line.startswith("[tool call call_")]
    assert len(calls) == 2 and all(" add {" in line for line in calls), chat.stdout
    unused = _expertctl("infer", "Hi", "--tool-choice", "add", *target)
    assert unused.returncode == 2 and "--tool-choice: give the tools too" in unused.stderr
