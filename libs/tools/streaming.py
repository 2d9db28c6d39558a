"""One choice's output split, as it is generated, into content and tool-call deltas (docs/api.md
#tool-calling): the one owner of that split, which the engine applies to every stream, so that
gRPC, the OpenAI API and the Responses API send the same deltas and never the call's markup.

The output is decided by its start (the grammar leaves no other outcome: text under `auto` may not
start the way a call starts): text goes out as content as it comes; calls go out as OpenAI streams
them, per call first its index, id and name (once the name's string has closed), then its
arguments in pieces as the model writes them. vLLM's streaming parsers re-parse partial JSON and
send the difference of its re-serialisation; our calls are grammar-enforced JSON, so the pieces are
the model's own text of the arguments object, and they add up to exactly the call's `arguments`.
At the end the calls are checked by the whole-output parser (libs/tools/parsing.py), which decides
what the choice's calls are.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

from libs.tools.envelope import Envelope
from libs.tools.families import ToolFamily
from libs.tools.parsing import new_call_id, parse_calls

_ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass(frozen=True)
class CallDelta:
    """A piece of call `index` (0, 1, ... in the choice): the first names it (`id`, `name`), the
    others carry a piece of its `arguments`."""

    index: int
    id: str = ""
    name: str = ""
    arguments: str = ""


@dataclass(frozen=True)
class FinishedCall:
    id: str
    name: str
    arguments: str  # JSON text of an object: the pieces streamed for the call, put together


@dataclass
class _Call:
    id: str
    envelope: Envelope = field(default_factory=Envelope)
    name: str | None = None  # set once announced
    sent: str = ""  # the arguments sent so far


class CallStream:
    """The split of one choice's output: `feed` each new piece of text, then `finish` once."""

    def __init__(self, family: ToolFamily, new_id: Callable[[], str] = new_call_id) -> None:
        self.family, self.new_id = family, new_id
        self.text = ""
        self.mode: str | None = None  # "text" or "calls", once the start decides it
        self.position = 0  # how far the calls were read
        self.calls: list[_Call] = []
        self.current: _Call | None = None  # the call whose envelope is being read
        self.expecting = [family.call_start] if family.format == "hermes" else []
        self.broken = False  # the text stopped being calls: read no further

    def feed(self, piece: str) -> tuple[str, list[CallDelta]]:
        """The content and the call deltas that `piece`, the output's next text, makes known."""
        self.text += piece
        if self.mode is None:
            start = self.family.call_start
            if not self.text.startswith(start) and start.startswith(self.text):
                return "", []  # maybe a call's start: wait for more
            self.mode = "calls" if self.text.startswith(start) else "text"
            piece = self.text
        if self.mode == "text":
            return piece, []
        return "", self._read()

    def finish(self, cut: bool) -> tuple[str, list[CallDelta], list[FinishedCall]]:
        """The last content and deltas, and the choice's calls (none: it is text). `cut`: the
        output ended at max_tokens, and only its complete calls count (a first call cut short makes
        neither calls nor content)."""
        if self.mode == "text":  # all sent already
            return "", [], []
        if self.mode is None:  # the start of a call, cut short; or (no grammar) a text like "<"
            return ("" if cut else self.text), [], []
        parsed = parse_calls(self.family, self.text, cut=cut)
        if parsed is None:
            # Not calls after all (the grammar rules this out; a cut first call aside): text, as
            # the whole-output parser says.
            return ("", [], []) if cut else (self.text, [], [])
        deltas: list[CallDelta] = []
        finished = []
        for index, call in enumerate(parsed):
            streamed = self.calls[index] if index < len(self.calls) else _Call(self.new_id())
            arguments = self._arguments(streamed) or call.arguments
            deltas += self._complete(index, streamed, call.name, arguments)
            finished.append(FinishedCall(streamed.id, call.name, arguments))
        return "", deltas, finished

    def _read(self) -> list[CallDelta]:
        deltas: list[CallDelta] = []
        while not self.broken and self.position < len(self.text):
            if self.current is None and not self._open_call():
                break
            call = self.current
            self.position = call.envelope.scan(self.text, self.position)
            deltas += self._announce(len(self.calls) - 1, call)
            if call.envelope.done:
                self.current = None
                self.expecting = ["</tool_call>", "<tool_call>"] if self.family.format == "hermes" else [";"]
        return deltas

    def _open_call(self) -> bool:
        """Read up to the next envelope's `{` (the markup and separators before it); False when
        the text does not go that far yet, or goes elsewhere (then `broken`)."""
        while True:
            rest = self.text[self.position :].lstrip()
            skipped = len(self.text) - self.position - len(rest)
            wanted = self.expecting[0] if self.expecting else "{"
            if rest.startswith(wanted) and self.expecting:
                self.position += skipped + len(wanted)
                self.expecting.pop(0)
            elif rest.startswith(wanted):
                self.position += skipped
                self.current = _Call(self.new_id())
                self.calls.append(self.current)
                return True
            else:
                self.broken = not wanted.startswith(rest)  # else it may still come
                return False

    def _announce(self, index: int, call: _Call) -> list[CallDelta]:
        """The deltas the text read so far makes known of `call`: its name once complete, then
        the arguments written since the last piece."""
        deltas = []
        if call.name is None:
            name = self._value(call, "name")
            if not isinstance(name, str):
                return []
            call.name = name
            deltas.append(CallDelta(index, id=call.id, name=name))
        piece = self._new_arguments(call)
        if piece:
            call.sent += piece
            deltas.append(CallDelta(index, arguments=piece))
        return deltas

    def _value(self, call: _Call, key: str) -> object:
        span = call.envelope.spans.get(key)
        if span is None:
            return None
        try:
            return json.loads(self.text[span[0] : span[1]])
        except json.JSONDecodeError:
            return None

    def _new_arguments(self, call: _Call) -> str:
        envelope = call.envelope
        for key in _ARGUMENT_KEYS:
            if key in envelope.spans:
                start, end = envelope.spans[key]
                break
            if envelope.open_key == key:
                start, end = envelope.token_start, self.position
                break
        else:
            return ""
        return self.text[start + len(call.sent) : end]

    def _arguments(self, call: _Call) -> str | None:
        """The call's arguments as streamed, once its envelope is complete (None: not complete)."""
        if not call.envelope.done or not call.sent:
            return None
        return call.sent

    def _complete(self, index: int, call: _Call, name: str, arguments: str) -> list[CallDelta]:
        """What is still to send of a call the final parse confirmed."""
        deltas = []
        if call.name is None:
            call.name = name
            deltas.append(CallDelta(index, id=call.id, name=name))
        if arguments.startswith(call.sent) and len(arguments) > len(call.sent):
            deltas.append(CallDelta(index, arguments=arguments[len(call.sent) :]))
            call.sent = arguments
        return deltas
