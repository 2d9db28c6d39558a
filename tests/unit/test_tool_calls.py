"""Tool calling's parts without a model (docs/api.md#tool-calling): the families told from their
templates, the grammar (checked with llguidance over bytes: what it accepts and refuses), the
parsers, and the rendering: through a Qwen-style template, token for token what transformers'
apply_chat_template makes of the same OpenAI-shaped conversation; through SmolLM2's, the fallback."""

from __future__ import annotations

import json

import pytest

from libs.engine.tokenizer import Tokenizer
from libs.gen.expert.v1 import common_pb2, engine_pb2
from libs.structured_output import StructuredOutput, text_problem
from libs.tools.families import FALLBACK, ToolFamily, family_of
from libs.tools.grammar import FunctionSpec, tool_grammar
from libs.tools.parsing import ParsedCall, new_call_id, parse_calls
from services.engine.tool_calls import RequestTools, session_messages
from tests.helpers.tokenizer_fixtures import SMOLLM2_TEMPLATE, save_checkpoint_dir, train_byte_level_bpe
from tests.unit.test_chat_template import LLAMA3_STYLE_TEMPLATE, QWEN_STYLE_TEMPLATE

transformers = pytest.importorskip("transformers")

HERMES = ToolFamily("hermes", native=True)
LLAMA3 = ToolFamily("llama3_json", native=True)
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
}
TIME = {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}
FUNCTIONS = [FunctionSpec("get_weather", WEATHER), FunctionSpec("get_time", TIME)]


def hermes_call(name: str, arguments: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def test_families_are_told_from_their_templates():
    assert family_of(QWEN_STYLE_TEMPLATE) == HERMES
    assert family_of(LLAMA3_STYLE_TEMPLATE) == LLAMA3
    assert family_of(SMOLLM2_TEMPLATE) == FALLBACK
    assert family_of(None) == FALLBACK


def _accepts(grammar: str, text: str) -> bool:
    return text_problem(StructuredOutput("grammar", grammar), text) is None


def test_a_required_call_must_name_a_tool_and_validate_against_its_schema():
    grammar = tool_grammar(FALLBACK, FUNCTIONS, allow_text=False, parallel=False)
    assert _accepts(grammar, hermes_call("get_weather", {"city": "Paris", "unit": "c"}))
    assert _accepts(grammar, hermes_call("get_time", {"zone": "UTC"}))
    assert not _accepts(grammar, hermes_call("get_weather", {"city": "Paris"}))  # unit is required
    assert not _accepts(grammar, hermes_call("get_weather", {"city": "Paris", "unit": "k"}))
    assert not _accepts(grammar, hermes_call("get_time", {"zone": "UTC", "extra": 1}))
    assert not _accepts(grammar, hermes_call("delete_all", {}))
    assert not _accepts(grammar, "The weather is fine.")
    two = hermes_call("get_time", {"zone": "UTC"}) + "\n" + hermes_call("get_time", {"zone": "CET"})
    assert not _accepts(grammar, two)  # parallel_tool_calls false: one call
    assert _accepts(tool_grammar(FALLBACK, FUNCTIONS, allow_text=False, parallel=True), two)


def test_auto_allows_text_or_calls_but_no_malformed_call():
    grammar = tool_grammar(FALLBACK, FUNCTIONS, allow_text=True, parallel=True)
    assert _accepts(grammar, "The weather is fine.")
    assert _accepts(grammar, hermes_call("get_time", {"zone": "UTC"}))
    assert not _accepts(grammar, '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def test_a_named_function_is_the_only_one_callable():
    grammar = tool_grammar(FALLBACK, FUNCTIONS[1:], allow_text=False, parallel=False)
    assert _accepts(grammar, hermes_call("get_time", {"zone": "UTC"}))
    assert not _accepts(grammar, hermes_call("get_weather", {"city": "Paris", "unit": "c"}))


def test_llama3_calls_are_bare_json_with_parameters():
    grammar = tool_grammar(LLAMA3, FUNCTIONS, allow_text=True, parallel=True)
    call = json.dumps({"name": "get_time", "parameters": {"zone": "UTC"}})
    assert _accepts(grammar, call)
    assert _accepts(grammar, call + "; " + call)
    assert _accepts(grammar, "It is noon.")
    assert not _accepts(grammar, json.dumps({"name": "get_time", "arguments": {"zone": "UTC"}}))


def test_parameters_with_definitions_keep_their_references():
    schema = {
        "type": "object",
        "properties": {"place": {"$ref": "#/$defs/Place"}},
        "required": ["place"],
        "$defs": {
            "Place": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
        },
    }
    grammar = tool_grammar(FALLBACK, [FunctionSpec("go", schema)], allow_text=False, parallel=False)
    assert _accepts(grammar, hermes_call("go", {"place": {"city": "Rome"}}))
    assert not _accepts(grammar, hermes_call("go", {"place": {"town": "Rome"}}))


@pytest.mark.parametrize(
    ("family", "text", "expected"),
    [
        (FALLBACK, hermes_call("f", {"a": 1}), [ParsedCall("f", '{"a": 1}')]),
        (
            FALLBACK,
            hermes_call("f", {}) + "\n" + hermes_call("g", {"b": "x"}),
            [ParsedCall("f", "{}"), ParsedCall("g", '{"b": "x"}')],
        ),
        (FALLBACK, "Just text with <tool_call> inside", None),
        (FALLBACK, '<tool_call>\n{"name": "f", "arguments": {"a": 1', None),  # cut by max_tokens
        (FALLBACK, hermes_call("f", {}) + " and then text", None),
        (
            LLAMA3,
            '{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}',
            [ParsedCall("f", '{"a": 1}'), ParsedCall("g", "{}")],
        ),
        (LLAMA3, '{"name": "f", "parameters": [1]}', None),
        (LLAMA3, "plain text", None),
    ],
)
def test_the_parsers_read_calls_and_leave_anything_else_as_text(family, text, expected):
    assert parse_calls(family, text) == expected


def test_a_text_cut_by_max_tokens_keeps_its_complete_calls():
    whole = hermes_call("f", {"a": 1})
    assert parse_calls(FALLBACK, whole + '\n<tool_call>\n{"name": "f", "argu', cut=True) == [
        ParsedCall("f", '{"a": 1}')
    ]
    assert parse_calls(FALLBACK, '<tool_call>\n{"name": "f", "argu', cut=True) is None
    assert parse_calls(LLAMA3, '{"name": "f", "parameters": {}}; {"name": "g"', cut=True) == [
        ParsedCall("f", "{}")
    ]


def test_call_ids_are_openai_shaped_and_unique():
    ids = {new_call_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(i.startswith("call_") and len(i) == 29 and i[5:].isalnum() for i in ids)


TOOLS = [
    common_pb2.Tool(name="get_weather", description="The weather in a city", parameters=json.dumps(WEATHER)),
    common_pb2.Tool(name="get_time", parameters=json.dumps(TIME)),
]
HISTORY = [
    common_pb2.ChatMessage(role="user", content="Weather in Paris?", name="ann"),
    common_pb2.ChatMessage(
        role="assistant",
        tool_calls=[
            common_pb2.ToolCall(
                id="call_1", type="function", name="get_weather", arguments='{"city": "Paris", "unit": "c"}'
            )
        ],
    ),
    common_pb2.ChatMessage(role="tool", tool_call_id="call_1", content="21 C, sunny"),
]
OPENAI_HISTORY = [
    {"role": "user", "content": "Weather in Paris?", "name": "ann"},
    {
        "role": "assistant",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "21 C, sunny"},
]
OPENAI_TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The weather in a city", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]


@pytest.fixture
def checkpoint(tmp_path):
    def make(template: str):
        config = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": template}
        directory = save_checkpoint_dir(tmp_path / "ckpt", train_byte_level_bpe(), config)
        return Tokenizer.from_dir(directory), transformers.PreTrainedTokenizerFast.from_pretrained(
            str(directory)
        )

    return make


def _params(**fields) -> common_pb2.GenerationParams:
    return common_pb2.GenerationParams(tools=TOOLS, parallel_tool_calls=True, **fields)


def test_a_native_template_renders_tools_calls_and_results_as_transformers_does(checkpoint):
    ours, reference = checkpoint(QWEN_STYLE_TEMPLATE)
    tools = RequestTools(
        ours, _params(tool_choice=common_pb2.ToolChoice(mode=common_pb2.TOOL_CHOICE_MODE_AUTO))
    )
    assert tools.family == HERMES
    expected = reference.apply_chat_template(
        OPENAI_HISTORY, tools=OPENAI_TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert "<tools>" in expected and "<tool_response>\n21 C, sunny" in expected
    assert tools.prompt(HISTORY) == ours.encode(expected, add_special_tokens=False)


def test_a_template_without_tools_gets_the_fallback_rendering(checkpoint):
    ours, _ = checkpoint(SMOLLM2_TEMPLATE)
    tools = RequestTools(ours, _params(tool_choice=common_pb2.ToolChoice(function="get_time")))
    assert tools.family == FALLBACK
    messages = tools.prompt(HISTORY)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert "<tools>\n" + json.dumps(OPENAI_TOOLS[0]) in messages[0]["content"]
    assert messages[1] == {"role": "user", "content": "Weather in Paris?", "name": "ann"}
    assert messages[2]["content"] == hermes_call("get_weather", {"city": "Paris", "unit": "c"})
    assert messages[3]["content"] == "<tool_response>\n21 C, sunny\n</tool_response>"
    grammar = tools.structured().spec
    assert _accepts(grammar, hermes_call("get_time", {"zone": "UTC"}))
    assert not _accepts(grammar, hermes_call("get_weather", {"city": "Paris", "unit": "c"}))


def test_tool_choice_none_shows_the_tools_but_enforces_and_parses_nothing(checkpoint):
    ours, _ = checkpoint(SMOLLM2_TEMPLATE)
    tools = RequestTools(
        ours, _params(tool_choice=common_pb2.ToolChoice(mode=common_pb2.TOOL_CHOICE_MODE_NONE))
    )
    assert tools.structured() is None
    assert "<tools>" in tools.prompt(HISTORY[:1])[0]["content"]
    assert tools.split() is None  # the output is text as it comes, whatever it looks like


def test_the_engine_sends_a_call_as_deltas_and_ends_the_choice_with_it(checkpoint):
    ours, _ = checkpoint(SMOLLM2_TEMPLATE)
    required = common_pb2.ToolChoice(mode=common_pb2.TOOL_CHOICE_MODE_REQUIRED)
    split = RequestTools(ours, _params(tool_choice=required)).split()
    output = hermes_call("get_time", {"zone": "UTC"})
    responses = [engine_pb2.GenerateResponse(text=output[i : i + 3]) for i in range(0, len(output), 3)]
    responses.append(engine_pb2.GenerateResponse(finish_reason=common_pb2.FINISH_REASON_STOP))
    for response in responses:
        split.apply(response)
    assert all(r.text == "" for r in responses)
    deltas = [d for r in responses for d in r.tool_call_deltas]
    last = responses[-1]
    assert last.finish_reason == common_pb2.FINISH_REASON_TOOL_CALLS
    [call] = last.tool_calls
    assert (deltas[0].id, deltas[0].name) == (call.id, "get_time") and call.id.startswith("call_")
    assert "".join(d.arguments for d in deltas) == call.arguments == '{"zone": "UTC"}'


def test_a_session_turn_lists_its_tools_before_its_messages_and_calls_in_the_fallback_format(checkpoint):
    ours, _ = checkpoint(QWEN_STYLE_TEMPLATE)  # a native template: a session still takes the fallback
    params = _params(tool_choice=common_pb2.ToolChoice(mode=common_pb2.TOOL_CHOICE_MODE_REQUIRED))
    assert RequestTools(ours, params, fallback=True).family == FALLBACK
    later = [common_pb2.ChatMessage(role="user", content="And in Rome?")]
    listed = session_messages(later, TOOLS)
    assert [m["role"] for m in listed] == ["system", "user"]
    assert "<tools>\n" + json.dumps(OPENAI_TOOLS[0]) in listed[0]["content"]
    assert listed[1] == {"role": "user", "content": "And in Rome?"}
    # A result (and a turn that lists nothing anew) renders as the fallback's, role and content only.
    assert session_messages(HISTORY[2:], []) == [
        {"role": "user", "content": "<tool_response>\n21 C, sunny\n</tool_response>"}
    ]
    first = [common_pb2.ChatMessage(role="system", content="Be brief."), *HISTORY[:1]]
    merged = session_messages(first, TOOLS)
    assert [m["role"] for m in merged] == ["system", "user"]
    assert merged[0]["content"].startswith("Be brief.\n\n") and "<tools>" in merged[0]["content"]
