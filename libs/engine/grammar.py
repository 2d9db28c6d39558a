"""Structured output in the engine: formats compiled into llguidance matchers for this model's
tokenizer, and one matcher per output sequence that says which tokens may come next.

llguidance was chosen over xgrammar by measurement on this machine (docs/engine.md#structured-output).
A format is compiled once (about a millisecond for a small schema, up to a second for a huge one)
and kept in an LRU keyed by its content hash; a request then takes a copy of the compiled matcher,
which costs microseconds. Compilation happens on whichever thread prepares the request, never on
the engine thread (AsyncLLMEngine.compile_structured runs it in an executor first).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import llguidance
import torch

from libs.engine.errors import InvalidRequestError
from libs.engine.tokenizer import Tokenizer
from libs.structured_output import StructuredOutput, error_reason, grammar_text

# Compiled formats kept; a repeated schema (the common case) is never compiled twice. Bounded by
# count, as llguidance reports no sizes: a format's matcher builds its lexer states as masks are
# computed, and they live as long as the cached matcher (measured with SmolLM2's 49k vocabulary:
# about 0.3 MB for a small regex or schema, more for a large one), so 256 formats held some 75 MB
# and more, the growth issue 34 saw over the regex tests. 64 keeps that near 20 MB.
CACHE_SIZE = 64


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row of a token bitmask (bit i of word j allows token 32 * j + i)."""
    return (vocab_size + 31) // 32


class GrammarMatcher:
    """Where one output sequence stands in its format: the tokens allowed next, and whether the
    format is complete. Follows the sequence's output tokens one by one."""

    __slots__ = ("_matcher",)

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (a CPU int32 tensor, contiguous rows).
        The end-of-sequence ids are set only where the format can end."""
        words = bitmask[row]
        self._matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.element_size())

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token; False if the format did not allow it (the matcher is then
        in an error state for good)."""
        return self._matcher.consume_token(token_id)

    def validate(self, token_ids: list[int]) -> int:
        """How many of these tokens, in a row from here, the format allows (nothing is consumed)."""
        return self._matcher.validate_tokens(token_ids)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (drafts consumed only to compute masks)."""
        if num_tokens:
            self._matcher.rollback(num_tokens)

    def fork(self) -> GrammarMatcher:
        """An independent copy at the same place, for a sibling output of an n > 1 request."""
        return GrammarMatcher(self._matcher.deep_copy())

    @property
    def is_terminated(self) -> bool:
        """The format is complete and nothing more may follow (an end token was accepted, or the
        grammar has no continuation)."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str:
        return self._matcher.get_error()


class CompiledGrammar:
    """A format compiled for one tokenizer; each request starts from a fresh copy."""

    __slots__ = ("_pristine",)

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._pristine = matcher

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._pristine.deep_copy())


class GrammarCompiler:
    """Compiles formats for one model, keeping the last CACHE_SIZE by content hash. Thread-safe;
    compiling holds no lock, so a slow schema delays only its own request."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, capacity: int = CACHE_SIZE) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's rows of logits; ids past the tokenizer's are never allowed
        self.capacity = capacity
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def compile(self, structured: StructuredOutput) -> CompiledGrammar:
        """The compiled format, from the cache or compiled now; InvalidRequestError naming
        `structured` when llguidance refuses it."""
        key = structured.key
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return compiled
            self.misses += 1
        try:
            grammar = grammar_text(structured)
        except ValueError as exc:
            raise InvalidRequestError("structured", f"not a JSON schema object: {exc}") from None
        matcher = llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError("structured", error_reason(matcher.get_error()))
        compiled = CompiledGrammar(matcher)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > self.capacity:
                self._cache.popitem(last=False)
        return compiled

    def _tokenizer(self) -> llguidance.LLTokenizer:
        # Built on first use (a fifth of a second for a 49k vocabulary); a race builds it twice, harmlessly.
        if self._ll_tokenizer is None:
            eos = sorted(i for i in self.tokenizer.eos_token_ids if i < self.vocab_size)
            self._ll_tokenizer = llguidance.LLTokenizer(
                self.tokenizer.backend.to_str(), n_vocab=self.vocab_size, eos_token=eos or None
            )
        return self._ll_tokenizer
