"""The engine's text layer on text no tokenizer can take (a lone surrogate, decoded from a call's
JSON arguments or a tool's schema): refused naming where it is, as the request's error, never a
bare TypeError ("TextInputSequence must be str") that the engine would answer as INTERNAL."""

from __future__ import annotations

import pytest

from libs.engine.tokenizer import ChatTemplateError, Tokenizer, UnencodableTextError
from libs.gen.expert.v1 import common_pb2
from libs.tools.rendering import template_messages
from services.engine.__main__ import map_error
from tests.helpers.tokenizer_fixtures import build_byte_level_dir

S = "\ud800"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_dir(build_byte_level_dir(tmp_path_factory.mktemp("tokenizer")))


def test_text_with_a_lone_surrogate_is_refused_by_encode_saying_where(tokenizer):
    with pytest.raises(UnencodableTextError, match=r"U\+D800\) at character 3"):
        tokenizer.encode("abc" + S)


def test_a_surrogate_decoded_from_a_calls_arguments_names_the_argument(tokenizer):
    # the arguments as reception's gRPC callers may send them: JSON text whose escape decodes to one
    call = common_pb2.ToolCall(id="c1", name="f", arguments='{"a": "\\ud800"}')
    messages = template_messages(
        [
            common_pb2.ChatMessage(role="user", content="hi"),
            common_pb2.ChatMessage(role="assistant", tool_calls=[call]),
        ]
    )
    with pytest.raises(ChatTemplateError) as info:
        tokenizer.apply_chat_template(messages)
    assert info.value.field == "messages[1].tool_calls[0].function.arguments.a"
    assert "lone surrogate" in info.value.description


def test_a_surrogate_in_a_tools_schema_names_the_tool(tokenizer):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"description": S}}}]
    with pytest.raises(ChatTemplateError) as info:
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=tools)
    assert info.value.field == "tools[0].function.parameters.description"


def test_a_templates_own_refusal_blames_the_messages():
    error = ChatTemplateError("Conversation roles must alternate user/assistant: got two users")
    assert (error.field, error.description) == ("messages", str(error))
    named = ChatTemplateError("messages[2].role: expected one of system, user")
    assert (named.field, named.description) == ("messages[2].role", "expected one of system, user")


@pytest.mark.parametrize(
    "error, field",
    [
        (ChatTemplateError("messages[0].content: not valid Unicode text"), "messages[0].content"),
        (ChatTemplateError("Error: roles must alternate"), "messages"),
        (UnencodableTextError("not valid Unicode text"), "input"),
    ],
)
def test_the_engine_answers_a_request_it_cannot_render_or_tokenize_as_invalid_argument(error, field):
    mapped = map_error(error)
    assert mapped is not None and mapped.code.name == "INVALID_ARGUMENT"
    assert mapped.violations[0][0] == field
