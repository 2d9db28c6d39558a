"""Streaming detokenization of one output sequence, with stop strings.

Decoding token by token is wrong in two ways: a byte-level token can end inside a UTF-8 character
(its text is U+FFFD until later tokens complete it), and SentencePiece decoders drop the leading
space of the first token they see ("▁world" alone decodes to "world"). So each step decodes a small
window, a few context tokens whose text is already out plus the new ones, and emits what the window
added beyond that, holding back a trailing U+FFFD run until the character completes (the prefix /
read offset technique). The context moves up after every step that decodes cleanly, so a call costs
O(window), not O(sequence length). A character that never completes (the sequence was cut by
max_tokens, a stop or an abort) never reaches the text: only its token ids are kept.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from .tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
# Prompt tokens decoded as context before the first output token: enough for SentencePiece's
# leading space to come out as in the full text (" Paris" after "The capital is").
_PROMPT_CONTEXT_TOKENS = 6
# Text still ending in U+FFFD after this many tokens without progress holds a real U+FFFD (or
# garbage bytes): emit it. Generous because a byte-fallback decoder shows a whole run of byte tokens
# as U+FFFD until the run ends on a character boundary, which steps of several tokens may miss.
_MAX_STALLED_TOKENS = 64
# Tokens that each end inside a character (emoji runs, CJK under byte merges) never decode cleanly;
# past this window length the context is moved to the newest clean token boundary instead.
_MAX_WINDOW_TOKENS = 24


class IncrementalDetokenizer:
    """Turns the token ids of one sequence, as they are generated, into text deltas.

    `add(ids)` returns the text those ids completed. For byte-level BPE the deltas concatenate to
    `tokenizer.decode(output_ids)` less a character cut off at its end; after a prompt, SentencePiece
    text keeps the leading space the full decode of prompt + output has (" Paris"). `flush()`
    releases what is held back, except the bytes of a character that was never finished.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], *, skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        context_text = self._decode(context)
        if context_text.endswith(_REPLACEMENT):
            # The prompt ends inside a character: its bytes cannot be split between prompt and output.
            context, context_text = [], ""
        self._ids = context  # the window: context tokens, then the tokens after them
        self._num_context = len(context)
        self._num_emitted_chars = len(context_text)  # of decode(window), the context's text included
        self._num_stalled = 0  # tokens added since the text last grew or decoded cleanly

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(
            ids, skip_special_tokens=self._skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def add(self, new_token_ids: Sequence[int]) -> str:
        """Append generated ids; return the newly complete text (possibly empty)."""
        if not new_token_ids:
            return ""
        self._ids.extend(new_token_ids)
        self._num_stalled += len(new_token_ids)
        text = self._decode(self._ids)
        held = text.endswith(_REPLACEMENT)
        if held and self._num_stalled < _MAX_STALLED_TOKENS:
            text = text.rstrip(_REPLACEMENT)
        elif held:
            # Stalled: a U+FFFD the model produced goes out, but never a character still unfinished.
            complete = self._without_unfinished_character(self._ids, text)
            held = complete != text
            text = complete
        delta = text[self._num_emitted_chars :]
        if not held:
            self._settle()
            return delta
        if delta:
            self._num_emitted_chars = len(text)
            self._num_stalled = 0
        if len(self._ids) - self._num_context > _MAX_WINDOW_TOKENS:
            self._move_context()
        return delta

    def flush(self) -> str:
        """At the end of the sequence, release the held text; the bytes of a character the sequence
        never finished are left out (they would decode as U+FFFD)."""
        text = self._without_unfinished_character(self._ids, self._decode(self._ids))
        delta = text[self._num_emitted_chars :]
        self._settle()
        return delta

    def _without_unfinished_character(self, ids: list[int], text: str) -> str:
        """`text`, the decode of `ids`, less a character cut off at its end: trailing bytes that begin a
        UTF-8 character without finishing it. A U+FFFD that stands for bytes no continuation can make
        valid, or for the character U+FFFD itself, stays."""
        if not text.endswith(_REPLACEMENT):
            return text
        tail, pieces = b"", []  # the last bytes (at least 4 when there are), (index, size) per token
        for index in range(len(ids) - 1, -1, -1):
            data = self._tokenizer.token_bytes(ids[index], self._skip_special_tokens)
            if data is None:  # a token of whole characters: a character boundary
                break
            tail = data + tail
            pieces.append((index, len(data)))
            if len(tail) >= 4:
                break
        unfinished = _unfinished_utf8(tail)
        if not unfinished:
            return text
        size, cut = 0, len(ids)
        for index, token_size in pieces:
            size, cut = size + token_size, index
            if size >= unfinished:
                break
        if size == unfinished:  # the unfinished bytes are whole tokens: the text without them
            return self._decode(ids[:cut])
        # They begin inside a token, which only byte-level BPE allows: its decoder shows them as one U+FFFD.
        return text[:-1]

    def _settle(self) -> None:
        # All decoded text is out: the tokens after the old context become the new context.
        self._ids = self._ids[self._num_context :]
        self._num_context = len(self._ids)
        self._num_emitted_chars = len(self._decode(self._ids))
        self._num_stalled = 0

    def _move_context(self) -> None:
        # The context may end at any recent token boundary whose text is complete and already out;
        # decoders only vary at the edges (a first token's space, a last incomplete character).
        for k in range(len(self._ids) - 1, max(self._num_context, len(self._ids) - 8), -1):
            head = self._decode(self._ids[:k])
            if head.endswith(_REPLACEMENT) or len(head) > self._num_emitted_chars:
                continue
            context = self._ids[self._num_context : k]
            self._num_emitted_chars += len(self._decode(context)) - len(head)
            self._ids = self._ids[self._num_context :]
            self._num_context = len(context)
            return


def _unfinished_utf8(data: bytes) -> int:
    """How many bytes at the end of `data` begin a UTF-8 character without finishing it (0 to 3):
    a lead byte and fewer continuation bytes than it announces, all of which some continuation
    completes into a valid character."""
    for size in range(1, min(len(data), 3) + 1):
        lead = data[-size]
        if 0x80 <= lead <= 0xBF:  # a continuation byte: the lead is further back
            continue
        need = 2 if 0xC2 <= lead <= 0xDF else 3 if 0xE0 <= lead <= 0xEF else 4 if 0xF0 <= lead <= 0xF4 else 0
        if size >= need:  # ASCII, a byte no character starts with, or a character already complete
            return 0
        if size == 1:
            return 1
        try:  # the second byte has lead-specific limits; later ones only need to be continuations
            (data[-size:] + b"\x80" * (need - size)).decode("utf-8")
        except UnicodeDecodeError:
            return 0
        return size
    return 0


class StopStringMatcher:
    """Cuts a text stream at the first stop string, never emitting any part of one.

    `feed(delta)` returns the text safe to emit now and the stop string that completed, if any.
    Text that could still grow into a stop string is held back; when several stop strings complete
    in the same delta, the one ending first wins (then the longest), as if text arrived one
    character at a time. After a match nothing more is emitted. `flush()` releases held text when
    the sequence ends for another reason (eos, length).
    """

    def __init__(self, stop: Sequence[str], include_in_output: bool = False) -> None:
        if isinstance(stop, str) or not isinstance(stop, Sequence):
            raise ValueError("stop: expected a list of strings")
        for i, s in enumerate(stop):
            if not isinstance(s, str):
                raise ValueError(f"stop[{i}]: expected a string, got {type(s).__name__}")
            if not s:
                raise ValueError(f"stop[{i}]: must not be empty")
        self._stops = tuple(dict.fromkeys(stop))
        self._include = include_in_output
        # Knuth-Morris-Pratt: per stop string, its failure table and how much of it the text ends
        # with. Memory is linear in the stop strings' total length, and each character costs
        # amortized constant work per stop string.
        self._fail = [_failure_table(s) for s in self._stops]
        self._state = [0] * len(self._stops)
        self._held = ""
        self._matched: str | None = None

    @property
    def matched(self) -> str | None:
        """The stop string that ended the stream, or None."""
        return self._matched

    def feed(self, delta: str) -> tuple[str, str | None]:
        """Add decoded text; return (text to emit now, the stop string that just matched or None)."""
        if self._matched is not None:
            return "", None
        if not self._stops:
            return delta, None
        text = self._held + delta
        for position, char in enumerate(delta, start=len(self._held) + 1):
            completed = [i for i in range(len(self._stops)) if self._advance(i, char)]
            if completed:  # the earliest end wins, then the longest stop string
                stop = max((self._stops[i] for i in completed), key=len)
                self._matched, self._held = stop, ""
                return text[: position - len(stop)] + (stop if self._include else ""), stop
        # Hold back the longest tail that is still the start of a stop string.
        held = max(self._state)
        self._held = text[len(text) - held :]
        return text[: len(text) - held], None

    def _advance(self, i: int, char: str) -> bool:
        stop, fail, k = self._stops[i], self._fail[i], self._state[i]
        while k and stop[k] != char:
            k = fail[k - 1]
        if stop[k] == char:
            k += 1
        if k == len(stop):
            self._state[i] = fail[k - 1]
            return True
        self._state[i] = k
        return False

    def flush(self) -> str:
        """Release the held-back text (nothing after a match)."""
        held, self._held = self._held, ""
        return held


def _failure_table(pattern: str) -> array:
    """fail[k]: the length of the longest proper prefix of pattern[: k + 1] that is also its suffix."""
    fail = array("i", bytes(4 * len(pattern)))
    k = 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = fail[k - 1]
        if pattern[i] == pattern[k]:
            k += 1
        fail[i] = k
    return fail


@dataclass(frozen=True, slots=True)
class TextDelta:
    """What one step added to a sequence's text, and the stop string that ended it (if any)."""

    text: str
    stop_string: str | None = None


class TextStream:
    """Per-sequence text output: incremental detokenization followed by stop-string matching.

    `append(ids)` returns a TextDelta; once `stop_string` is set the engine should finish the
    sequence, and later appends return nothing. `finish()` returns the held-back tail when the
    sequence ends for another reason. `text` is everything emitted so far.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        *,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self._detokenizer = IncrementalDetokenizer(
            tokenizer, prompt_token_ids, skip_special_tokens=skip_special_tokens
        )
        self._matcher = StopStringMatcher(stop, include_in_output=include_stop_str_in_output)
        self._pieces: list[str] = []

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._pieces) > 1:
            self._pieces[:] = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the sequence, or None."""
        return self._matcher.matched

    def append(self, token_ids: Sequence[int]) -> TextDelta:
        """Feed generated ids; return the text safe to show and the stop string if one completed."""
        if self._matcher.matched is not None:
            return TextDelta("")
        text, stop = self._matcher.feed(self._detokenizer.add(token_ids))
        self._emit(text)
        return TextDelta(text, stop)

    def finish(self) -> str:
        """End the sequence: return the text still held back (an incomplete character, a stop prefix)."""
        if self._matcher.matched is not None:
            return ""
        text, _ = self._matcher.feed(self._detokenizer.flush())
        text += self._matcher.flush()
        self._emit(text)
        return text

    def _emit(self, text: str) -> None:
        if text:
            self._pieces.append(text)
