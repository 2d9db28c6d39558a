"""Request state as plain data: token ids, progress counters and the block table. No torch."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING

from libs.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from libs.engine.adapters.registry import ExpertUse, LoadedExpert
    from libs.engine.grammar import GrammarMatcher

_MASK64 = (1 << 64) - 1
_seq_ids = itertools.count()


class SequenceStatus(IntEnum):
    """Lifecycle of a sequence; every finished state sorts after the live ones."""

    WAITING = 0
    RUNNING = 1
    FINISHED_STOPPED = 2
    FINISHED_LENGTH = 3
    FINISHED_ABORTED = 4

    @property
    def is_finished(self) -> bool:
        return self >= SequenceStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {
            SequenceStatus.FINISHED_STOPPED: "stop",
            SequenceStatus.FINISHED_LENGTH: "length",
            SequenceStatus.FINISHED_ABORTED: "abort",
        }.get(self)


def derive_seed(seed: int, index: int) -> int:
    """The seed of output `index` (>= 1) of an n > 1 request seeded with `seed` (splitmix64).

    Output 0 uses the request's seed itself, so output i of a seeded n > 1 request equals an n = 1
    request seeded with `derive_seed(seed, i)` (or `seed` for i = 0).
    """
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def output_seed(request_seed: int, index: int) -> int:
    return request_seed if index == 0 else derive_seed(request_seed, index)


@dataclass
class SpeculationState:
    """A sequence's adaptive draft length and its recent acceptance (speculative.py keeps it)."""

    k: int
    acceptance: float = 1.0  # running average of accepted / drafted
    pause: int = 0  # steps left without drafting
    backoff: int = 8  # the next pause; doubled each time the sequence falls back again
    drafted: int = 0
    accepted: int = 0


PLACEHOLDER = -1  # a token id no vocabulary has: a token sampled on the device, not yet read back


class Sequence:
    """One output sequence of a request: prompt + generated tokens and how far the KV cache is.

    `num_computed_tokens` counts tokens whose keys and values are in the cache. Prefill and decode
    are the same thing: each step computes some of the tokens in [num_computed_tokens, num_tokens);
    when it reaches the end, the last position's logits yield the next token.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        request_seed: int,
        priority: int = 0,
        arrival_time: float = 0.0,
        index: int = 0,
        experts: tuple[ExpertUse, ...] = (),
        adapter_key: bytes = b"",
        num_virtual_tokens: int = 0,
        penalty_exempt_ids: tuple[int, ...] = (),
        grammar: GrammarMatcher | None = None,
    ) -> None:
        self.seq_id = next(_seq_ids)
        self.request_id = request_id
        self.index = index
        # Soft prompts occupy the first positions; their placeholder ids are never looked up.
        self.num_virtual_tokens = num_virtual_tokens
        self.token_ids = [0] * num_virtual_tokens + list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.params = params
        self.penalty_exempt_ids = penalty_exempt_ids  # RequestBuilder.penalty_exempt_ids
        # The output's place in its structured format, advanced by every token it samples. It
        # depends on the output tokens only, so preemption (which keeps them) leaves it valid.
        self.grammar = grammar
        self.request_seed = request_seed
        self.seed = output_seed(request_seed, index)
        self.priority = priority
        self.arrival_time = arrival_time
        self.experts = experts
        self.adapter_key = adapter_key  # covers the experts, versions and weights: part of every block hash
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prefix-cache hits at the last admission
        self.num_preemptions = 0
        self.block_table: list[int] = []
        # Edits of block_table other than appends (a copy-on-write, a trim, a release): a table kept
        # on the device by a decode graph is sent again whole after one (graph_tables.py).
        self.table_edits = 0
        self.block_hashes: list[bytes] = []  # chained hashes of the full blocks of token_ids
        # Samples still to draw from the first logits row: n (or best_of) for a request's first
        # sequence with several (it forks into them), 1 otherwise. A beam search's first sequence
        # counts its beams too (the admission reserves room for them) but draws one row.
        self.num_pending_forks = params.num_seqs if index == 0 else 1
        # A beam's next-token candidates: the sampler reports this many most likely tokens (0: not a beam).
        self.beam_candidates = 0
        # The session this sequence is a turn of (SessionTable.begin_turn): kept, not freed, at its end.
        self.session_id: str | None = None
        # Speculative decoding: drafted tokens sit at the end of token_ids during the step that
        # verifies them (so the step computes them like a prompt chunk), and are taken off after it.
        self.num_draft_tokens = 0
        self.speculation: SpeculationState | None = None  # adaptive K, made by the Speculator
        # Asynchronous scheduling: tokens sampled by a step whose results are still on the device sit
        # at the end of token_ids as PLACEHOLDER (so the scheduler counts and places them) until the
        # host reads them back one step later (`resolve_placeholder`).
        self.num_placeholders = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens, drafts under verification included (see `draft_token_ids`)."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def draft_token_ids(self) -> list[int]:
        return self.token_ids[len(self.token_ids) - self.num_draft_tokens :]

    def add_draft(self, draft: list[int]) -> None:
        """Put drafted tokens after the real ones for the step that verifies them."""
        self.token_ids.extend(draft)
        self.num_draft_tokens = len(draft)

    def discard_draft(self) -> list[int]:
        """Take the drafts off again (after their step, or when the sequence is preempted)."""
        draft = self.draft_token_ids
        if self.num_draft_tokens:
            del self.token_ids[-self.num_draft_tokens :]
            self.num_draft_tokens = 0
        return draft

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def prompt_token_ids(self) -> list[int]:
        """The real prompt, without soft-prompt placeholders."""
        return self.token_ids[self.num_virtual_tokens : self.num_prompt_tokens]

    @property
    def adapter_experts(self) -> list[LoadedExpert]:
        return [use.expert for use in self.experts]

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def num_top_logprobs(self) -> int | None:
        """Most likely tokens (with the sampled token's log-prob) the sampler reports per position:
        a beam's candidates, the request's logprobs, or 0 when best_of ranks outputs by log-prob."""
        if self.beam_candidates:
            return self.beam_candidates
        if self.params.logprobs is None and self.params.ranks_outputs:
            return 0
        return self.params.logprobs

    def sample_seeds(self) -> list[int]:
        """Seeds of the rows to sample from this sequence's next logits (several when it forks)."""
        if self.num_pending_forks > 1 and not self.beam_candidates:
            return [output_seed(self.request_seed, i) for i in range(self.num_pending_forks)]
        return [self.seed]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def append_placeholder(self) -> None:
        """A token sampled on the device, its value not yet read back."""
        self.token_ids.append(PLACEHOLDER)
        self.num_placeholders += 1

    def resolve_placeholder(self, token_id: int) -> None:
        """The oldest placeholder's value, read back."""
        self.token_ids[len(self.token_ids) - self.num_placeholders] = token_id
        self.num_placeholders -= 1

    def drop_placeholders(self) -> int:
        """Take off the placeholders still pending (the sequence ended before them); how many."""
        dropped, self.num_placeholders = self.num_placeholders, 0
        if dropped:
            del self.token_ids[-dropped:]
        return dropped

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose values the host has: all but the placeholders."""
        return len(self.token_ids) - self.num_placeholders

    def fork(self, index: int) -> Sequence:
        """Output `index` of the same request, sharing everything computed so far (the caller
        shares the block table)."""
        child = Sequence(
            self.request_id,
            self.prompt_token_ids,
            self.params,
            request_seed=self.request_seed,
            priority=self.priority,
            arrival_time=self.arrival_time,
            index=index,
            experts=self.experts,
            adapter_key=self.adapter_key,
            num_virtual_tokens=self.num_virtual_tokens,
            penalty_exempt_ids=self.penalty_exempt_ids,
            grammar=None if self.grammar is None else self.grammar.fork(),
        )
        child.token_ids = list(self.token_ids)
        child.num_computed_tokens = self.num_computed_tokens
        child.num_cached_tokens = self.num_cached_tokens
        child.block_hashes = list(self.block_hashes)
        child.status = self.status
        child.num_pending_forks = 1
        return child

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, request={self.request_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, status={self.status.name})"
        )
