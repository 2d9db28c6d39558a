"""Turning what a caller sends into a validated Request: prompt, sampling settings, priority, experts."""

from __future__ import annotations

import random
import time
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from typing import Any

from libs.engine.adapters.manager import ExpertManager, ExpertSpec
from libs.engine.beam_search import BeamSearch
from libs.engine.errors import InvalidRequestError
from libs.engine.grammar import GrammarCompiler
from libs.engine.models.config import ModelConfig
from libs.engine.request import Request
from libs.engine.sampling_params import SamplingParams
from libs.engine.sequence import Sequence
from libs.engine.sessions import SessionRef
from libs.engine.tokenizer import ChatTemplateError, Tokenizer, UnencodableTextError

# A prompt: text, token ids, or a chat conversation (a list of {"role", "content"} messages).
Prompt = str | list[int] | list[Mapping[str, Any]]


class RequestBuilder:
    """Validates and tokenizes requests; reads engine settings but changes no engine state, so it may
    run on any thread (the async front validates on the caller's side)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        model_config: ModelConfig,
        max_model_len: int,
        kv_capacity: int,
        max_num_seqs: int,
        experts: ExpertManager,
        rng: random.Random,
        grammars: GrammarCompiler,
    ) -> None:
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.max_model_len = max_model_len
        self.kv_capacity = kv_capacity  # tokens the whole KV cache holds
        self.max_num_seqs = max_num_seqs
        self.experts = experts
        self._rng = rng
        self.grammars = grammars

    def build(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | None,
        priority: int,
        arrival_time: float | None,
        experts: ExpertSpec | None,
        session: SessionRef | None = None,
        *,
        resume: Seq[int] = (),
    ) -> Request:
        """The Request and its first sequence, or InvalidRequestError naming the field. `resume`:
        the output tokens an earlier run of the request already gave its caller (`_resume`)."""
        params = params or SamplingParams()
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id", "must be a non-empty string")
        self._check_sequences(params, session)
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidRequestError("priority", f"expected an integer, got {priority!r}")
        resolved = self.experts.resolve(experts)
        text, token_ids = self._tokenize(prompt)
        self._check_lengths(token_ids, params, resolved.num_virtual_tokens)
        vocab = self.model_config.vocab_size
        for i, token in enumerate(params.stop_token_ids):
            if token >= vocab:
                raise InvalidRequestError(
                    f"stop_token_ids[{i}]", f"{token} is outside the vocabulary (size {vocab})"
                )
        # Cached after the first request with this format (AsyncLLMEngine compiles it beforehand).
        grammar = None if params.structured is None else self.grammars.compile(params.structured).matcher()
        seed = params.seed if params.seed is not None else self._rng.getrandbits(64)
        now = time.monotonic() if arrival_time is None else arrival_time
        seq = Sequence(
            request_id,
            token_ids,
            params,
            request_seed=seed,
            priority=priority,
            arrival_time=now,
            experts=resolved.uses,
            adapter_key=resolved.adapter_key,
            num_virtual_tokens=resolved.num_virtual_tokens,
            penalty_exempt_ids=self.penalty_exempt_ids(params),
            grammar=grammar,
        )
        request = Request(request_id, text, token_ids, params, seq, self.tokenizer, self.max_model_len, now)
        request.session = session
        if params.use_beam_search:
            request.beam = self._beam_search(params, seq)
        if resume:
            self._resume(request, list(resume))
        return request

    def _check_sequences(self, params: SamplingParams, session: SessionRef | None) -> None:
        """The sequences the request runs (n, best_of or beams) fit the batch, and a session turn
        runs exactly one."""
        if session is not None:
            if not session.session_id:
                raise InvalidRequestError("session.session_id", "must be a non-empty string")
            if params.n != 1:  # one conversation continues from one output
                raise InvalidRequestError("n", f"a session turn has one output, not {params.n}")
            if params.num_seqs != 1:  # ... and keeps the KV of that one sequence
                raise InvalidRequestError("best_of", "a session turn runs one sequence: no best_of or beams")
        if params.num_seqs > self.max_num_seqs:
            name = "n" if params.best_of is None else "best_of"
            raise InvalidRequestError(
                name, f"{params.num_seqs} sequences exceed max_num_seqs {self.max_num_seqs}"
            )

    def _beam_search(self, params: SamplingParams, seq: Sequence) -> BeamSearch:
        """The request's beam search, its first beam the prompt's sequence. Its end tokens are the
        ones that stop an ordinary output; max_tokens (else the context window) bounds its length."""
        ending = set(params.stop_token_ids) | (
            set() if params.ignore_eos else set(self.tokenizer.eos_token_ids)
        )
        room = self.max_model_len - seq.num_tokens
        search = BeamSearch(
            width=params.num_seqs,
            max_new_tokens=room if params.max_tokens is None else min(params.max_tokens, room),
            end_ids=frozenset(ending),
            length_penalty=float(params.length_penalty),
            early_stopping=params.early_stopping,
        )
        search.start(seq.seq_id)
        seq.beam_candidates = search.keep
        return search

    def _resume(self, request: Request, tokens: list[int]) -> None:
        """Make `tokens` the start of the request's one output, as if it had sampled them: they take
        the output positions (the sampler draws from (seed, output position), so a greedy or seeded
        request goes on as an uninterrupted run would), its format is advanced over them, and its
        text stream, stop strings and max_tokens count them. Only what follows is sent."""
        params, seq = request.params, request.seqs[0]
        if params.num_seqs != 1 or request.session is not None:
            raise InvalidRequestError(
                "resume_token_ids", "only a request with one output, not a session turn"
            )
        vocab = self.model_config.vocab_size
        ending = set(params.stop_token_ids) | (set() if params.ignore_eos else self.tokenizer.eos_token_ids)
        for i, token in enumerate(tokens):
            if not 0 <= token < vocab or token in ending:
                raise InvalidRequestError(
                    f"resume_token_ids[{i}]", f"{token} is not a token an output goes on after"
                )
            if seq.grammar is not None and not seq.grammar.accept(token):
                raise InvalidRequestError(
                    f"resume_token_ids[{i}]", f"{token} is outside the request's format"
                )
        if (params.max_tokens is not None and len(tokens) >= params.max_tokens) or (
            seq.num_tokens + len(tokens) >= self.max_model_len
        ):
            raise InvalidRequestError("resume_token_ids", f"{len(tokens)} tokens leave no room to generate")
        if seq.grammar is not None and seq.grammar.is_terminated:
            raise InvalidRequestError("resume_token_ids", "the output's format is already complete")
        seq.token_ids.extend(tokens)
        request.resume(tokens)

    def penalty_exempt_ids(self, params: SamplingParams) -> tuple[int, ...]:
        """The ids a request's penalties leave alone: the tokenizer's control tokens (eos ids included,
        whether or not the request ignores eos) and the request's stop ids. Empty without penalties."""
        if not params.uses_penalties:
            return ()
        vocab = self.model_config.vocab_size
        ids = self.tokenizer.control_token_ids.union(params.stop_token_ids)
        return tuple(sorted(i for i in ids if i < vocab))

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt", "must not be empty")
            return prompt, self._encode(prompt, "prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(m, Mapping) for m in prompt):
            try:
                text = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True)
            except ChatTemplateError as exc:
                raise InvalidRequestError(exc.field, exc.description) from None
            return text, self._encode(text, "messages", add_special_tokens=False)
        if isinstance(prompt, list) and prompt:
            vocab = self.model_config.vocab_size
            for i, token in enumerate(prompt):
                if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab:
                    raise InvalidRequestError(
                        f"prompt_token_ids[{i}]", f"{token!r} is not a token id in [0, {vocab})"
                    )
            return None, list(prompt)
        raise InvalidRequestError(
            "prompt", "expected text, a non-empty list of token ids, or a list of messages"
        )

    def _encode(self, text: str, field: str, add_special_tokens: bool = True) -> list[int]:
        """The tokens of `text`: text no tokenizer can take is the request's error, naming `field`."""
        try:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        except UnencodableTextError as exc:
            raise InvalidRequestError(field, str(exc)) from None

    def _check_lengths(self, token_ids: list[int], params: SamplingParams, num_virtual: int = 0) -> None:
        if not token_ids:
            raise InvalidRequestError("prompt", "encodes to zero tokens")
        limit = self.max_model_len - num_virtual  # soft prompts take positions too
        if limit < 2:
            raise InvalidRequestError(
                "experts",
                f"soft prompts of {num_virtual} tokens leave no room within "
                f"max_model_len {self.max_model_len}",
            )
        context = f"max_model_len {self.max_model_len}" + (
            f" less {num_virtual} soft-prompt tokens" if num_virtual else ""
        )
        if len(token_ids) >= limit:
            raise InvalidRequestError(
                "prompt", f"{len(token_ids)} tokens leave no room to generate within {context}"
            )
        if params.max_tokens is not None and len(token_ids) + params.max_tokens > limit:
            raise InvalidRequestError(
                "max_tokens",
                f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds {context}",
            )
        longest = num_virtual + len(token_ids) + (params.max_tokens or limit - len(token_ids))
        capacity = self.kv_capacity
        if longest > capacity:
            raise InvalidRequestError(
                "max_tokens", f"a sequence of {longest} tokens cannot fit the KV cache ({capacity} tokens)"
            )
