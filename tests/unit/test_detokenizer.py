"""Streaming detokenization never splits a character, keeps SentencePiece spaces, and cuts at stop strings."""

from __future__ import annotations

import codecs
import contextlib
import random
import tracemalloc

import pytest

from libs.engine.tokenizer import (
    IncrementalDetokenizer,
    StopStringMatcher,
    TextDelta,
    TextStream,
    Tokenizer,
)
from tests.helpers.tokenizer_fixtures import SAMPLE_TEXTS, build_byte_level_dir, build_sentencepiece_dir

REPLACEMENT = "\ufffd"
MULTIBYTE_TEXT = "Café crème, 日本語のテキスト, 中文测试 😀🎉👍🏽 🇫🇷 — naïve Straße 🦄"


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_dir(build_byte_level_dir(tmp_path_factory.mktemp("byte_level")))


@pytest.fixture(scope="module")
def sentencepiece(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_dir(build_sentencepiece_dir(tmp_path_factory.mktemp("sentencepiece")))


def _random_chunks(ids: list[int], rng: random.Random) -> list[list[int]]:
    """Split ids into steps of 1-4 tokens, as decode steps and speculative decoding deliver them."""
    chunks, i = [], 0
    while i < len(ids):
        size = rng.randint(1, 4) if rng.random() < 0.3 else 1
        chunks.append(ids[i : i + size])
        i += size
    return chunks


def _stream(detokenizer: IncrementalDetokenizer, chunks: list[list[int]]) -> list[str]:
    return [detokenizer.add(chunk) for chunk in chunks] + [detokenizer.flush()]


def _complete_text(tokenizer: Tokenizer, ids: list[int], skip_special_tokens: bool = True) -> str:
    """Reference: the text of byte-level `ids` less a character cut off at the end, by Python's
    incremental UTF-8 decoder, which holds back exactly such trailing bytes."""
    data = b"".join(tokenizer.token_bytes(i, skip_special_tokens) for i in ids)
    assert data.decode("utf-8", errors="replace") == tokenizer.decode(ids, skip_special_tokens)
    return codecs.getincrementaldecoder("utf-8")(errors="replace").decode(data, final=False)


def _byte_ids(tokenizer: Tokenizer, data: bytes) -> list[int]:
    """One single-byte token per byte (the byte-level alphabet or the <0xNN> byte-fallback tokens)."""
    singles = {}
    for i in range(tokenizer.vocab_size):
        token_bytes = tokenizer.token_bytes(i)
        if token_bytes is not None and len(token_bytes) == 1:
            singles.setdefault(token_bytes, i)
    return [singles[bytes([b])] for b in data]


def _sample_ids(tokenizer: Tokenizer, rng: random.Random) -> list[int]:
    texts = rng.sample([*SAMPLE_TEXTS, MULTIBYTE_TEXT], k=4)
    return tokenizer.encode(" ".join(texts), add_special_tokens=False)


# --- IncrementalDetokenizer ---------------------------------------------------------------------------


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_deltas_concatenate_to_the_full_decode_for_random_ids(byte_level, skip_special_tokens):
    rng = random.Random(1234)
    prompt = byte_level.encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    for _ in range(200):
        ids = [rng.randrange(byte_level.vocab_size) for _ in range(rng.randint(1, 40))]
        detokenizer = IncrementalDetokenizer(byte_level, prompt, skip_special_tokens=skip_special_tokens)
        deltas = _stream(detokenizer, _random_chunks(ids, rng))
        assert "".join(deltas) == _complete_text(byte_level, ids, skip_special_tokens)


def test_multibyte_characters_are_never_split(byte_level):
    ids = byte_level.encode(MULTIBYTE_TEXT, add_special_tokens=False)
    # The test only means something if some tokens end inside a character.
    assert any(REPLACEMENT in byte_level.decode([i]) for i in ids)
    deltas = _stream(IncrementalDetokenizer(byte_level, []), [[i] for i in ids])
    assert "".join(deltas) == MULTIBYTE_TEXT
    assert not any(REPLACEMENT in delta for delta in deltas)


@pytest.mark.parametrize("family", ["byte_level", "sentencepiece"])
def test_no_delta_holds_a_replacement_character_the_text_does_not(request, family):
    tokenizer = request.getfixturevalue(family)
    rng = random.Random(7)
    prompt = tokenizer.encode("Question: 日本語?")
    for _ in range(100):
        ids = _sample_ids(tokenizer, rng)
        deltas = _stream(IncrementalDetokenizer(tokenizer, prompt), _random_chunks(ids, rng))
        assert not any(REPLACEMENT in delta for delta in deltas)
        expected = tokenizer.decode(prompt + ids)[len(tokenizer.decode(prompt)) :]
        assert "".join(deltas) == expected


def test_a_character_completed_by_several_tokens_is_emitted_once_whole(byte_level):
    ids = byte_level.encode("🦄", add_special_tokens=False)
    assert len(ids) > 1
    detokenizer = IncrementalDetokenizer(byte_level, [])
    assert [detokenizer.add([i]) for i in ids] == [""] * (len(ids) - 1) + ["🦄"]


def test_flush_leaves_out_a_character_the_sequence_never_finished(byte_level):
    ids = byte_level.encode("ab", add_special_tokens=False) + _byte_ids(byte_level, "🦄".encode()[:3])
    assert byte_level.decode(ids) == "ab" + REPLACEMENT
    detokenizer = IncrementalDetokenizer(byte_level, [])
    assert detokenizer.add(ids) == "ab"
    assert detokenizer.flush() == ""


def test_a_cut_inside_a_token_that_also_holds_whole_characters_drops_only_the_cut_bytes(byte_level):
    # Byte-level merges make tokens such as " \xf0\x9f": a space, then the first bytes of an emoji.
    mixed = {}
    for i in range(byte_level.vocab_size):
        data = byte_level.token_bytes(i)
        lead = next((k for k in range(1, 4) if len(data) > k and 0xC2 <= data[-k] <= 0xF4), None)
        if lead is not None and data[-lead:].decode(errors="ignore") == "":
            with contextlib.suppress(UnicodeDecodeError):
                mixed[i] = data[:-lead].decode()
    assert len(mixed) >= 5 and " " in mixed.values()
    prompt_like = byte_level.encode("x", add_special_tokens=False)
    for token, whole in mixed.items():
        ids = [*prompt_like, token]
        assert byte_level.decode(ids) == "x" + whole + REPLACEMENT
        detokenizer = IncrementalDetokenizer(byte_level, [])
        assert detokenizer.add(ids) + detokenizer.flush() == "x" + whole


def test_a_replacement_character_the_model_wrote_is_kept_even_at_the_end(byte_level):
    # U+FFFD as a character (EF BF BD) and bytes no continuation can make valid (FF, a lone C0).
    for data, text in ((b"ab\xef\xbf\xbd", "ab" + REPLACEMENT), (b"ab\xff", "ab" + REPLACEMENT)):
        ids = _byte_ids(byte_level, data)
        assert "".join(_stream(IncrementalDetokenizer(byte_level, []), [[i] for i in ids])) == text
    ids = _byte_ids(byte_level, b"\xc0ab\xe4\xb8")  # invalid in the middle, unfinished at the end
    assert "".join(_stream(IncrementalDetokenizer(byte_level, []), [[i] for i in ids])) == REPLACEMENT + "ab"


def test_sentencepiece_byte_fallback_cut_keeps_the_whole_characters_of_the_run(sentencepiece):
    # Byte-fallback decoding shows a whole run of byte tokens as U+FFFD until it ends on a boundary.
    ids = sentencepiece.encode("Hi", add_special_tokens=False) + _byte_ids(sentencepiece, "日本".encode()[:5])
    assert sentencepiece.decode(ids).endswith(REPLACEMENT * 5)
    deltas = _stream(IncrementalDetokenizer(sentencepiece, []), [[i] for i in ids])
    assert "".join(deltas) == "Hi日"


def test_a_character_unfinished_when_the_stall_limit_is_reached_is_not_emitted(byte_level):
    # 63 bytes that can never be text, then a character in three tokens: the stall limit (64 tokens
    # without progress) falls on its first byte, which must wait for the other two.
    ids = _byte_ids(byte_level, b"\xff" * 63 + "中".encode())
    deltas = _stream(IncrementalDetokenizer(byte_level, []), [[i] for i in ids])
    assert "".join(deltas) == REPLACEMENT * 63 + "中"
    assert deltas[63:] == [REPLACEMENT * 63, "", "中", ""]


def test_a_prompt_ending_inside_a_character_does_not_corrupt_the_output(byte_level):
    ids = byte_level.encode("日本語", add_special_tokens=False)
    cut = next(k for k in range(1, len(ids)) if byte_level.decode(ids[:k]).endswith(REPLACEMENT))
    prompt, output = ids[:cut], ids[cut:]
    deltas = _stream(IncrementalDetokenizer(byte_level, prompt), [[i] for i in output])
    assert "".join(deltas) == byte_level.decode(output)


def test_sentencepiece_spaces_come_out_right(sentencepiece):
    text = "Hello world, how are you doing today?"
    ids = sentencepiece.encode(text, add_special_tokens=False)
    # Decoding token by token would lose every space: the decoder strips a first token's space.
    assert "".join(sentencepiece.decode([i]) for i in ids) != text
    deltas = _stream(IncrementalDetokenizer(sentencepiece, []), [[i] for i in ids])
    assert "".join(deltas) == text == sentencepiece.decode(ids)
    assert sum(delta.startswith(" ") for delta in deltas) == text.count(" ")


def test_sentencepiece_output_after_a_prompt_keeps_its_leading_space(sentencepiece):
    prompt = sentencepiece.encode("The capital of France is")
    output = sentencepiece.encode("Paris, of course.", add_special_tokens=False)
    deltas = _stream(IncrementalDetokenizer(sentencepiece, prompt), [[i] for i in output])
    assert "".join(deltas) == " Paris, of course."
    assert sentencepiece.decode(prompt + output) == "The capital of France is" + "".join(deltas)


def test_sentencepiece_byte_fallback_characters_are_never_split(sentencepiece):
    ids = sentencepiece.encode(MULTIBYTE_TEXT, add_special_tokens=False)
    assert any(REPLACEMENT in sentencepiece.decode([i]) for i in ids)
    deltas = _stream(IncrementalDetokenizer(sentencepiece, []), [[i] for i in ids])
    assert "".join(deltas) == MULTIBYTE_TEXT
    assert not any(REPLACEMENT in delta for delta in deltas)


def test_adding_no_ids_emits_nothing(byte_level):
    detokenizer = IncrementalDetokenizer(byte_level, byte_level.encode("prompt"))
    assert detokenizer.add([]) == ""
    assert detokenizer.flush() == ""


def test_special_tokens_are_skipped_or_kept_on_request(byte_level):
    ids = byte_level.encode("Hi<|im_end|>", add_special_tokens=False)
    assert "".join(_stream(IncrementalDetokenizer(byte_level, []), [[i] for i in ids])) == "Hi"
    kept = IncrementalDetokenizer(byte_level, [], skip_special_tokens=False)
    assert "".join(_stream(kept, [[i] for i in ids])) == "Hi<|im_end|>"


class _CountingTokenizer:
    """Wraps a Tokenizer and records how many ids each decode call received."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer, self.sizes = tokenizer, []

    def decode(self, ids, **kwargs):
        self.sizes.append(len(ids))
        return self.tokenizer.decode(ids, **kwargs)

    def token_bytes(self, token_id, skip_special_tokens=True):
        return self.tokenizer.token_bytes(token_id, skip_special_tokens)


def test_each_step_decodes_a_small_window_not_the_whole_output(byte_level):
    counting = _CountingTokenizer(byte_level)
    ids = byte_level.encode(MULTIBYTE_TEXT * 60, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(counting, byte_level.encode("prompt " * 100))
    assert "".join(_stream(detokenizer, [[i] for i in ids])) == MULTIBYTE_TEXT * 60
    assert len(ids) > 1000
    assert max(counting.sizes) <= 10


class _ByteChunkTokenizer:
    """A byte-level "tokenizer" whose tokens are given byte chunks, free to end inside a character."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks, self.sizes = chunks, []

    @classmethod
    def random_split(cls, text: str, rng: random.Random) -> _ByteChunkTokenizer:
        data, chunks = text.encode(), []
        while data:
            size = rng.randint(1, 5)
            chunks.append(data[:size])
            data = data[size:]
        return cls(chunks)

    def decode(self, ids, **kwargs):
        self.sizes.append(len(ids))
        return b"".join(self.chunks[i] for i in ids).decode("utf-8", errors="replace")

    def token_bytes(self, token_id, skip_special_tokens=True):
        return self.chunks[token_id]


def test_text_before_an_incomplete_character_is_not_delayed():
    tokenizer = _ByteChunkTokenizer(["ab🦄".encode()[:4], "🦄".encode()[2:]])
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    assert detokenizer.add([0]) == "ab"
    assert detokenizer.add([1]) == "🦄"


def test_tokens_that_all_end_inside_characters_stream_exactly_in_a_bounded_window():
    rng = random.Random(3)
    text = ("🇫🇷🇩🇪👍🏽日本語のテキスト" * 40) + " done"
    tokenizer = _ByteChunkTokenizer.random_split(text, rng)
    ids = list(range(len(tokenizer.chunks)))
    deltas = _stream(IncrementalDetokenizer(tokenizer, []), _random_chunks(ids, rng))
    assert "".join(deltas) == text
    assert not any(REPLACEMENT in delta for delta in deltas)
    assert max(tokenizer.sizes) <= 64


def test_a_stream_of_replacement_characters_is_not_held_forever(byte_level):
    replacement_ids = byte_level.encode(REPLACEMENT * 3, add_special_tokens=False)
    ids = replacement_ids * 100
    deltas = _stream(IncrementalDetokenizer(byte_level, []), [[i] for i in ids])
    assert "".join(deltas) == byte_level.decode(ids)
    assert sum(1 for delta in deltas[:-1] if delta) > 1


# --- StopStringMatcher ----------------------------------------------------------------------------------


def _first_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """Reference: scan one character at a time; the first stop string to complete wins (longest on ties)."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            stop = max(done, key=len)
            return end - len(stop), stop
    return None


def _feed_all(matcher: StopStringMatcher, pieces: list[str]) -> tuple[str, str | None]:
    emitted, matched = [], None
    for piece in pieces:
        text, stop = matcher.feed(piece)
        emitted.append(text)
        if stop is not None:
            assert matched is None, "a stop string is reported once"
            matched = stop
    if matched is None:
        emitted.append(matcher.flush())
    return "".join(emitted), matched


def test_a_stop_string_inside_one_delta_cuts_the_text():
    matcher = StopStringMatcher(["world"])
    assert matcher.feed("Hello world, bye") == ("Hello ", "world")
    assert matcher.matched == "world"


def test_a_stop_string_split_across_deltas_is_never_emitted():
    matcher = StopStringMatcher(["<|end|>"])
    assert matcher.feed("Answer: 42<") == ("Answer: 42", None)
    assert matcher.feed("|en") == ("", None)
    assert matcher.feed("d|> trailing") == ("", "<|end|>")


def test_overlapping_prefixes_release_only_what_cannot_start_a_stop():
    matcher = StopStringMatcher(["ab"])
    assert matcher.feed("a") == ("", None)
    assert matcher.feed("a") == ("a", None)
    assert matcher.feed("b") == ("", "ab")


def test_held_text_that_does_not_become_a_stop_is_released():
    matcher = StopStringMatcher(["Help!"])
    assert matcher.feed("Hel") == ("", None)
    assert matcher.feed("lo") == ("Hello", None)


def test_flush_releases_held_text():
    matcher = StopStringMatcher(["Help!"])
    assert matcher.feed("I said Hel") == ("I said ", None)
    assert matcher.flush() == "Hel"
    assert matcher.flush() == ""


def test_include_in_output_emits_the_stop_string_too():
    matcher = StopStringMatcher(["STOP"], include_in_output=True)
    assert _feed_all(matcher, ["go go ST", "OP now"]) == ("go go STOP", "STOP")


def test_nothing_is_emitted_after_a_match():
    matcher = StopStringMatcher(["x"])
    assert matcher.feed("ax") == ("a", "x")
    assert matcher.feed("more") == ("", None)
    assert matcher.flush() == ""


def test_the_stop_string_completing_first_wins():
    assert StopStringMatcher(["world", "lo w"]).feed("hello world") == ("hel", "lo w")
    assert StopStringMatcher(["bc", "abc"]).feed("xabc") == ("x", "abc")


def test_without_stop_strings_text_passes_through():
    matcher = StopStringMatcher([])
    assert matcher.feed("anything") == ("anything", None)


def test_random_streams_match_a_character_by_character_reference():
    rng = random.Random(99)
    alphabet = "ab c"
    for _ in range(500):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        stops = [
            "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))
        ]
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(1, 6))))
        pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        include = rng.random() < 0.5
        emitted, matched = _feed_all(StopStringMatcher(stops, include_in_output=include), pieces)
        expected = _first_stop(text, stops)
        if expected is None:
            assert (emitted, matched) == (text, None)
        else:
            start, stop = expected
            assert matched == stop
            assert emitted == text[:start] + (stop if include else "")
            assert not any(s in text[:start] for s in stops)


@pytest.mark.parametrize(
    ("stop", "error"),
    [
        (["ok", ""], r"stop\[1\]: must not be empty"),
        (["ok", 3], r"stop\[1\]: expected a string"),
        ("abc", "stop: expected a list of strings"),
    ],
)
def test_invalid_stop_strings_are_named(stop, error):
    with pytest.raises(ValueError, match=error):
        StopStringMatcher(stop)


# --- TextStream ----------------------------------------------------------------------------------------


def test_text_stream_cuts_at_a_stop_string_spanning_tokens(byte_level):
    ids = byte_level.encode("The answer is 42. Observation: done", add_special_tokens=False)
    stream = TextStream(byte_level, [], stop=["Observation:"])
    deltas = [stream.append([i]) for i in ids]
    assert "".join(d.text for d in deltas) == stream.text == "The answer is 42. "
    assert [d.stop_string for d in deltas if d.stop_string] == ["Observation:"]
    assert stream.stop_string == "Observation:"
    assert stream.append(ids[:2]) == TextDelta("")
    assert stream.finish() == ""


def test_text_stream_finish_releases_held_text(byte_level):
    ids = byte_level.encode("Almost Obs", add_special_tokens=False)
    stream = TextStream(byte_level, [], stop=["Observation:"])
    streamed = "".join(stream.append([i]).text for i in ids)
    assert streamed == "Almost "
    assert stream.finish() == "Obs"
    assert stream.text == "Almost Obs"
    assert stream.stop_string is None


def test_text_stream_includes_the_stop_string_on_request(byte_level):
    ids = byte_level.encode("café 😀 END more", add_special_tokens=False)
    stream = TextStream(byte_level, [], stop=["END"], include_stop_str_in_output=True)
    for i in ids:
        stream.append([i])
    assert stream.text == "café 😀 END"


def test_text_stream_without_stops_equals_the_full_decode(byte_level):
    rng = random.Random(5)
    ids = _sample_ids(byte_level, rng)
    stream = TextStream(byte_level, byte_level.encode("prompt"))
    pieces = [stream.append(chunk).text for chunk in _random_chunks(ids, rng)]
    pieces.append(stream.finish())
    assert "".join(pieces) == stream.text == byte_level.decode(ids)


def _first_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """The reference: the stop string that ends first in `text` (then the longest), and its start."""
    found = [(text.find(s) + len(s), -len(s), text.find(s), s) for s in stops if s in text]
    return min(found)[2:] if found else None


def test_the_stop_matcher_agrees_with_a_plain_search_on_random_streams():
    rng = random.Random(7)
    for _ in range(500):
        stops = [
            "".join(rng.choice("ab") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 4))
        ]
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 40)))
        include = rng.random() < 0.5
        matcher = StopStringMatcher(stops, include_in_output=include)
        out, matched, i = [], None, 0
        while i < len(text) and matched is None:
            step = rng.randint(1, 5)
            emitted, matched = matcher.feed(text[i : i + step])
            out.append(emitted)
            i += step
        if matched is None:
            out.append(matcher.flush())
        expected = _first_stop(text, stops)
        if expected is None:
            assert ("".join(out), matched) == (text, None)
        else:
            start, stop = expected
            assert matched == stop, (stops, text)
            assert "".join(out) == text[:start] + (stop if include else "")


def test_the_stop_matcher_uses_memory_linear_in_its_stop_strings():
    """A 200,000-character stop string once kept all its prefixes (about 20 GB); now a table of one
    integer per character."""
    long_stop = "ab" * 100_000
    tracemalloc.start()
    try:
        matcher = StopStringMatcher([long_stop, "x" * 200_000])
        for _ in range(100):
            assert matcher.feed("ab" * 50) == ("", None)  # held back: it may still become the stop
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 * 400_000  # bytes: a few per character of the stop strings
    assert matcher.flush() == "ab" * 5000
