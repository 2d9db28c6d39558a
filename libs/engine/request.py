"""Engine-side state of one request: its sequences (n outputs), their text streams and timings."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from libs.engine.adapters.registry import ExpertUse
from libs.engine.beam_search import BeamSearch
from libs.engine.errors import InvalidRequestError
from libs.engine.outputs import AppliedExpert, CompletionOutput, Logprob, RequestMetrics, RequestOutput
from libs.engine.sampler import SampledToken
from libs.engine.sampling_params import OutputKind, SamplingParams
from libs.engine.sequence import Sequence, SequenceStatus
from libs.engine.sessions import SessionRef
from libs.engine.tokenizer import TextStream, Tokenizer

log = logging.getLogger(__name__)


@dataclass
class _Output:
    """Everything one output produced so far, and how much of it the caller has been given."""

    index: int
    stream: TextStream
    pieces: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    sent_pieces: int = 0
    sent_tokens: int = 0

    def add_text(self, text: str) -> None:
        if text:
            self.pieces.append(text)

    def text(self, start: int = 0) -> str:
        return "".join(self.pieces[start:])


def _record_logprob(out: _Output, sample: SampledToken) -> None:
    """A sampled token's log-prob (when the sampler gave one: logprobs asked for, or best_of
    ranking the outputs by them) into its output's sum and, when asked for, its logprobs."""
    if sample.logprob is None:
        return
    out.cumulative_logprob = (out.cumulative_logprob or 0.0) + sample.logprob
    if out.logprobs is not None:
        token = sample.token_id
        ranked = {tid: Logprob(tid, lp, rank + 1) for rank, (tid, lp) in enumerate(sample.top_logprobs)}
        ranked.setdefault(token, Logprob(token, sample.logprob, sample.rank or 0))
        out.logprobs.append(ranked)


class Request:
    """A prompt, its settings and its outputs; turns sampled tokens into text and stop decisions."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        first: Sequence,
        tokenizer: Tokenizer,
        max_model_len: int,
        arrival_time: float,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.stop_ids = set(params.stop_token_ids)
        self.eos_ids = set() if params.ignore_eos else set(tokenizer.eos_token_ids)
        self.seqs: list[Sequence] = []
        self._outputs: list[_Output] = []
        self.metrics = RequestMetrics(arrival_time=arrival_time, num_prompt_tokens=len(prompt_token_ids))
        self.session: SessionRef | None = None  # set when the request is a turn of a session
        self.beam: BeamSearch | None = None  # set for use_beam_search: its beams are not outputs
        self.runs_ahead = False  # its steps may run ahead of their read-back (LLMEngine._can_run_ahead)
        self.experts: tuple[ExpertUse, ...] = first.experts
        self.applied = [
            AppliedExpert(u.expert.name, u.expert.version, u.expert.adapter_type, u.weight)
            for u in first.experts
        ]
        self.add_sequence(first)

    @property
    def finished(self) -> bool:
        if self.beam is not None:
            return self.beam.done
        return len(self.seqs) == self.params.num_seqs and all(seq.is_finished for seq in self.seqs)

    def add_sequence(self, seq: Sequence) -> None:
        self.seqs.append(seq)
        stream = TextStream(
            self.tokenizer,
            self.prompt_token_ids,
            stop=self.params.stop,
            include_stop_str_in_output=self.params.include_stop_str_in_output,
            skip_special_tokens=self.params.skip_special_tokens,
        )
        self._outputs.append(
            _Output(seq.index, stream, logprobs=[] if self.params.logprobs is not None else None)
        )

    def resume(self, tokens: list[int]) -> None:
        """Take `tokens` as the one output's start, already sent by an earlier run: its text stream
        reads them one by one as it read them then (holding back the same stop-string prefix), and
        their text is not sent again."""
        out = self._outputs[0]
        for i, token in enumerate(tokens):
            if out.stream.append([token]).stop_string is not None:
                raise InvalidRequestError(
                    f"resume_token_ids[{i}]", "the output already ended at a stop string"
                )

    def on_token(self, seq: Sequence, sample: SampledToken, now: float) -> SequenceStatus | None:
        """Record a sampled token already appended to `seq`; the finished status if it ends the sequence."""
        m = self.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        elif m.last_token_time is not None:
            m.inter_token_latencies.append(now - m.last_token_time)
        m.last_token_time = now
        m.num_generation_tokens += 1
        out = self._outputs[seq.index]
        token = sample.token_id
        out.token_ids.append(token)
        _record_logprob(out, sample)

        if token in self.eos_ids or token in self.stop_ids:
            out.add_text(out.stream.finish())
            out.stop_reason = token if token in self.stop_ids else None
            return SequenceStatus.FINISHED_STOPPED
        grammar_done = False
        if seq.grammar is not None:
            accepted = seq.grammar.accept(token)
            if not accepted:  # cannot happen while the mask holds; end the output rather than run on
                log.error(
                    "request %s: token %d outside its format: %s", self.request_id, token, seq.grammar.error
                )
            grammar_done = not accepted or seq.grammar.is_terminated
        delta = out.stream.append([token])
        out.add_text(delta.text)
        if delta.stop_string is not None:
            out.stop_reason = delta.stop_string
            return SequenceStatus.FINISHED_STOPPED
        if grammar_done:  # the format is complete and allows nothing more, not even an end token
            out.add_text(out.stream.finish())
            return SequenceStatus.FINISHED_STOPPED
        # Counted without the placeholders of asynchronous scheduling: the tokens after this one.
        num_output = seq.num_output_tokens - seq.num_placeholders
        at_max = self.params.max_tokens is not None and num_output >= self.params.max_tokens
        if at_max or seq.num_known_tokens >= self.max_model_len:
            out.add_text(out.stream.finish())
            return SequenceStatus.FINISHED_LENGTH
        return None

    def mark_finished(self, seq: Sequence, status: SequenceStatus, now: float) -> None:
        """Record how a sequence ended (after the scheduler retired it)."""
        out = self._outputs[seq.index]
        if status == SequenceStatus.FINISHED_ABORTED:
            out.add_text(out.stream.finish())
        out.finish_reason = status.finish_reason
        if self.finished:
            self.record_finish(now)

    def record_finish(self, now: float) -> None:
        """The end of the request in its metrics (every output, or its beam search, is done)."""
        self.metrics.finished_time = now
        self.metrics.num_cached_tokens = self.seqs[0].num_cached_tokens
        self.metrics.num_preemptions = sum(s.num_preemptions for s in self.seqs)

    def _returned(self) -> list[_Output]:
        """The outputs the caller gets: all of them, or best_of's n with the highest cumulative
        log-prob (best first), or a beam search's n best hypotheses."""
        if self.beam is not None:
            return self._beam_outputs()
        outputs = sorted(self._outputs, key=lambda o: o.index)
        if self.params.ranks_outputs:
            outputs.sort(key=lambda o: -(o.cumulative_logprob or 0.0))  # stable: lower index wins ties
            return outputs[: self.params.n]
        return outputs

    def _beam_outputs(self) -> list[_Output]:
        outputs = []
        for hyp in self.beam.best(self.params.n):
            stream = TextStream(
                self.tokenizer, self.prompt_token_ids, skip_special_tokens=self.params.skip_special_tokens
            )
            ending = hyp.token_ids[-1:] if hyp.finish_reason == "stop" else []
            body = hyp.token_ids[: len(hyp.token_ids) - len(ending)]
            out = _Output(0, stream, token_ids=list(hyp.token_ids), cumulative_logprob=hyp.cumulative_logprob)
            out.add_text(stream.append(body).text)
            out.add_text(stream.finish())
            out.finish_reason = hyp.finish_reason
            out.stop_reason = ending[0] if ending and ending[0] in self.stop_ids else None
            outputs.append(out)
        return outputs

    def output(self) -> RequestOutput | None:
        """What the caller gets now, shaped by the request's output kind (None: nothing to send)."""
        kind = self.params.output_kind
        if self.beam is not None or self.params.ranks_outputs:
            # Which outputs are returned is known only at the end: nothing is sent before it.
            if not self.finished:
                return None
            kind = OutputKind.FINAL_ONLY
        elif kind == OutputKind.FINAL_ONLY and not self.finished:
            return None
        completions = []
        for index, out in enumerate(self._returned()):
            out.index = index
            start_piece, start_token = (
                (out.sent_pieces, out.sent_tokens) if kind == OutputKind.DELTA else (0, 0)
            )
            completions.append(
                CompletionOutput(
                    index=out.index,
                    text=out.text(start_piece),
                    token_ids=out.token_ids[start_token:],
                    finish_reason=out.finish_reason,
                    stop_reason=out.stop_reason,
                    logprobs=None if out.logprobs is None else out.logprobs[start_token:],
                    cumulative_logprob=out.cumulative_logprob,
                )
            )
            out.sent_pieces, out.sent_tokens = len(out.pieces), len(out.token_ids)
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            completions,
            self.finished,
            self.metrics,
            list(self.applied),
        )
