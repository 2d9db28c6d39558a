"""A request's tools in the engine (docs/api.md#tool-calling): the conversation rendered with them
(through the model's template, or the fallback rendering), the grammar that enforces a call in the
model family's format, and each choice's stream split into content and tool-call deltas, with its
calls at its end."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from libs.engine.tokenizer import ChatTemplateError, Tokenizer, UnencodableTextError
from libs.errors import invalid_argument
from libs.gen.expert.v1 import common_pb2, engine_pb2
from libs.structured_output import StructuredOutput
from libs.tools.families import FALLBACK, family_of
from libs.tools.grammar import FunctionSpec, parameters_schema, tool_grammar
from libs.tools.rendering import conversation, fallback_messages, template_messages, template_tools
from libs.tools.request import allows_text, callable_tools, calls_enabled
from libs.tools.streaming import CallStream


class RequestTools:
    """The tools of one Generate call (none at all is the common case and changes nothing)."""

    def __init__(
        self, tokenizer: Tokenizer, params: common_pb2.GenerationParams, *, fallback: bool = False
    ) -> None:
        """`fallback`: the calls take the fallback rendering's format whatever the template (a
        session's turn, whose tools session_messages lists)."""
        self.tokenizer = tokenizer
        self.params = params
        self.family = FALLBACK if fallback else family_of(tokenizer.template_source(tools=bool(params.tools)))
        self.enabled = calls_enabled(params)

    def structured(self) -> StructuredOutput | None:
        """The grammar of the calls the request allows (None when it allows none)."""
        if not self.enabled:
            return None
        functions = [
            FunctionSpec(t.name, parameters_schema(t.parameters)) for t in callable_tools(self.params)
        ]
        grammar = tool_grammar(
            self.family,
            functions,
            allow_text=allows_text(self.params),
            parallel=self.params.parallel_tool_calls,
        )
        return StructuredOutput("grammar", grammar)

    def prompt(self, messages: Any) -> list[dict[str, Any]] | list[int] | str:
        """The engine's prompt for a conversation: messages for the template, or (when the template
        is given tools) the rendered token ids. Raises INVALID_ARGUMENT for a conversation the
        template refuses."""
        rendered = template_messages(messages)
        if self.tokenizer.chat_template is None:  # a base model completes the conversation's text
            return "\n\n".join(m.get("content", "") for m in conversation(self.family, rendered, [])[0])
        chat, tools = conversation(self.family, rendered, template_tools(self.params.tools))
        if tools is None:
            return chat
        try:
            return self.tokenizer.encode_chat(chat, tools=tools)
        except ChatTemplateError as exc:
            raise invalid_argument(f"input.{exc.field}", exc.description) from None
        except UnencodableTextError as exc:
            raise invalid_argument("input.messages", str(exc)) from None

    def split(self, resumed_text: str = "") -> ChoiceSplit | None:
        """The split of the request's choices into content and calls (None: no call is allowed);
        `resumed_text`: the output an earlier run already gave the caller, read without sending
        anything again (GenerateRequest.resume_token_ids)."""
        return ChoiceSplit(self, resumed_text) if self.enabled else None


_ENDS = (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH)


class ChoiceSplit:
    """Each choice's messages rewritten: `text` is the content, the calls' pieces go in
    `tool_call_deltas`, and a choice that ends as calls gets them (`tool_calls`) and
    finish_reason TOOL_CALLS on its last message (one cut at max_tokens: its complete calls, as
    vLLM reports them)."""

    def __init__(self, tools: RequestTools, resumed_text: str) -> None:
        self.family = tools.family
        self.streams: dict[int, CallStream] = {}
        if resumed_text:  # resumption is for one choice only
            self._stream(0).feed(resumed_text)

    def _stream(self, index: int) -> CallStream:
        if index not in self.streams:
            self.streams[index] = CallStream(self.family)
        return self.streams[index]

    def apply(self, response: engine_pb2.GenerateResponse) -> None:
        stream = self._stream(response.index)
        content, deltas = stream.feed(response.text)
        calls = []
        if response.finish_reason in _ENDS:
            cut = response.finish_reason == common_pb2.FINISH_REASON_LENGTH
            more, last, calls = stream.finish(cut)
            content, deltas = content + more, deltas + last
        response.text = content
        response.tool_call_deltas.extend(
            common_pb2.ToolCallDelta(index=d.index, id=d.id, name=d.name, arguments=d.arguments)
            for d in deltas
        )
        if calls:
            response.tool_calls.extend(
                common_pb2.ToolCall(id=c.id, type="function", name=c.name, arguments=c.arguments)
                for c in calls
            )
            response.finish_reason = common_pb2.FINISH_REASON_TOOL_CALLS


def session_messages(
    messages: Iterable[common_pb2.ChatMessage], tools: Iterable[common_pb2.Tool]
) -> list[dict[str, str]]:
    """A session turn's messages as the template renders them message by message: the fallback
    rendering's (a tool result as a user turn in `<tool_response>` tags), `tools` listed in a system
    message before them (or in the turn's own first system message)."""
    rendered = fallback_messages(template_messages(messages), template_tools(tools))
    return [{"role": m["role"], "content": m.get("content", "")} for m in rendered]
