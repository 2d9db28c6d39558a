"""Chat templates: validate a conversation and render it to the prompt text the model was trained on.

Rendering follows transformers' `apply_chat_template(tokenize=False)` so prompts are byte-identical to
the reference: a sandboxed, immutable Jinja environment with trim_blocks/lstrip_blocks, the
loopcontrols extension, `raise_exception` and `strftime_now` globals, a JSON `tojson` filter and a
no-op `{% generation %}` tag. Templates come from checkpoints, i.e. untrusted code, hence the
sandbox; each distinct template source is compiled once.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from libs.utf8 import undecodable

ROLES = ("system", "user", "assistant", "tool")

# The standard field first: templates read `reasoning_content`, gpt-oss-style ones read `thinking`.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


# The field an error's text starts with (`messages[0].tool_calls[0].function.arguments: ...`): one
# of what a render is given, so that a template's own message ("Error: ...") is not taken for one.
_FIELD = re.compile(r"(messages|tools|chat_template)(\[\d+\])*(\.\w+(\[\d+\])*)*")


class ChatTemplateError(ValueError):
    """A conversation that cannot be rendered: invalid messages, a broken template, or none at all.
    Its text is `<field>: <what is wrong>` where a field is to blame; the template's own refusals
    (`raise_exception`) and failures name none, and blame the messages."""

    @property
    def field(self) -> str:
        """The field to blame: the one the text starts with, else `messages`."""
        head, sep, _ = str(self).partition(": ")
        return head if sep and _FIELD.fullmatch(head) else "messages"

    @property
    def description(self) -> str:
        """What is wrong, without the field."""
        head, sep, rest = str(self).partition(": ")
        return rest if sep and _FIELD.fullmatch(head) else str(self)


class _TemplateRaised(jinja2.exceptions.TemplateError):
    """Raised by the template's own `raise_exception(...)`; its message is meant for the caller."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: Any = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes ("<" becomes "\u003c"), which would change prompts.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Namespace(jinja2.utils.Namespace):
    """A jinja namespace that refuses underscore names, so a template cannot reach Python internals."""

    def __setitem__(self, name: str, value: Any) -> None:
        _check_namespace_name(name)
        super().__setitem__(name, value)


def _check_namespace_name(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} must not start with '_'")


def _namespace(*args: Any, **kwargs: Any) -> _Namespace:
    attrs = dict(*args, **kwargs)
    for name in attrs:
        _check_namespace_name(name)
    return _Namespace(attrs)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training; we render the body."""

    tags = frozenset({"generation"})

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _make_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _namespace
    return env


_ENVIRONMENT = _make_environment()


@lru_cache(maxsize=64)
def _compile(source: str) -> jinja2.Template:
    try:
        return _ENVIRONMENT.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template: invalid Jinja at line {exc.lineno}: {exc.message}") from exc


def _validate_content(content: Any, where: str) -> None:
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise ChatTemplateError(
            f"{where}: expected a string or a list of text parts, got {type(content).__name__}"
        )
    for j, part in enumerate(content):
        if not isinstance(part, Mapping):
            raise ChatTemplateError(f"{where}[{j}]: expected an object like {{'type': 'text', 'text': ...}}")
        if part.get("type") != "text":
            raise ChatTemplateError(f"{where}[{j}].type: expected 'text', got {part.get('type')!r}")
        if not isinstance(part.get("text"), str):
            raise ChatTemplateError(f"{where}[{j}].text: expected a string")


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check a conversation and return plain-dict copies ready for a template.

    Each message needs a `role` (one of ROLES) and a `content` (a string or a list of
    `{"type": "text", "text": ...}` parts); an assistant message carrying `tool_calls` may omit it.
    Like transformers, keys whose value is None are dropped and a reasoning field is mirrored
    under all its common names. Raises ChatTemplateError naming the offending field.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ChatTemplateError("messages: expected a non-empty list of messages")
    checked = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"{where}: expected an object with 'role' and 'content'")
        message = {key: value for key, value in message.items() if value is not None}
        role = message.get("role")
        if role is None:
            raise ChatTemplateError(f"{where}.role: required")
        if role not in ROLES:
            raise ChatTemplateError(f"{where}.role: expected one of {', '.join(ROLES)}; got {role!r}")
        if "content" in message:
            _validate_content(message["content"], f"{where}.content")
        elif not (role == "assistant" and message.get("tool_calls")):
            raise ChatTemplateError(f"{where}.content: required")
        reasoning = next((message[key] for key in _REASONING_FIELDS if key in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        checked.append(message)
    return checked


def _validate_tools(tools: Any) -> list[dict[str, Any]]:
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise ChatTemplateError("tools: expected a list of JSON-schema objects")
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise ChatTemplateError(f"tools[{i}]: expected a JSON-schema object, got {type(tool).__name__}")
    return [dict(tool) for tool in tools]


def _check_text(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> None:
    """Refuse text no tokenizer can take (a lone surrogate, decoded from a call's JSON arguments or
    a tool's schema), naming where it is, before the template renders it into the prompt."""
    found = undecodable(messages, "messages") or undecodable(tools or [], "tools")
    if found is not None:
        raise ChatTemplateError(f"{found[0]}: {found[1]}")


class ChatTemplate:
    """One compiled chat template. `render` validates the messages, then runs the template.

    Template variables: `messages`, `add_generation_prompt`, `tools` and `documents` (None unless
    given, as in transformers), then the caller's extra variables such as `bos_token`/`eos_token`.
    Errors, including the template's own `raise_exception`, surface as ChatTemplateError.
    """

    def __init__(self, source: str) -> None:
        if not isinstance(source, str) or not source.strip():
            raise ChatTemplateError("chat template: expected a non-empty Jinja string")
        self.source = source
        self._template = _compile(source)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **variables: Any,
    ) -> str:
        """Render `messages` to prompt text; see the class docstring for the variables a template sees."""
        context: dict[str, Any] = {"tools": None, "documents": None}
        context.update(variables)
        context["messages"] = validate_messages(messages)
        context["add_generation_prompt"] = add_generation_prompt
        if tools is not None:
            context["tools"] = _validate_tools(tools)
        _check_text(context["messages"], context["tools"])
        try:
            return self._template.render(**context)
        except _TemplateRaised as exc:
            raise ChatTemplateError(str(exc.message)) from exc
        except Exception as exc:  # whatever breaks inside an untrusted template is the template's error
            raise ChatTemplateError(f"chat template failed to render: {exc}") from exc
