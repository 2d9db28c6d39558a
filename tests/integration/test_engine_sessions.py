"""Sessions in the engine (libs/engine/sessions.py) on a tiny real model: a turn computes only what
its session did not keep, gives the tokens a stateless request with the whole history gives, and
the kept KV is given back when the session ends, expires or is evicted."""

from __future__ import annotations

import pytest

from libs.engine import LLMEngine, SamplingParams
from libs.engine.info import EngineLoad
from libs.engine.sessions import SessionBusyError, SessionFullError, SessionLimitError, SessionRef
from libs.engine.tokenizer import ChatTemplateError
from libs.engine.tokenizer.turns import encode_turn

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
USERS = [f"turn {i}: tell me about {word}" for i, word in enumerate("abcdefghij")]


def _engine(tiny_llama, **overrides) -> LLMEngine:
    settings = {"max_model_len": 1024, "num_blocks": 200, "block_size": 16} | overrides
    return LLMEngine.from_pretrained(str(tiny_llama), **settings)


def _run(engine: LLMEngine, request_id: str, prompt, params=GREEDY, session=None):
    engine.add_request(request_id, prompt, params, session=session)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out
    return final


class Conversation:
    """One session driven turn by turn, as the engine service drives it."""

    def __init__(self, engine: LLMEngine, session_id: str, idle_seconds: float = 0.0) -> None:
        self.engine, self.session_id, self.idle_seconds = engine, session_id, idle_seconds
        self.history: list[int] = []
        self.turns = 0

    def prompt(self, text: str | None) -> list[int]:
        messages = [] if text is None else [{"role": "user", "content": text}]
        return self.history + encode_turn(self.engine.tokenizer, self.history, messages)

    def turn(self, text: str | None, params=GREEDY):
        prompt = self.prompt(text)
        before = self.engine.get_stats().prompt_tokens_total
        ref = SessionRef(self.session_id, history_tokens=len(self.history), idle_seconds=self.idle_seconds)
        out = _run(self.engine, f"{self.session_id}-{self.turns}", prompt, params, ref)
        self.turns += 1
        prefilled = self.engine.get_stats().prompt_tokens_total - before
        kept = len(self.history)
        self.history = prompt + list(out.outputs[0].token_ids)
        return out, prompt, prefilled, kept


def test_ten_turns_compute_only_the_new_tokens_and_equal_stateless_requests(tiny_llama):
    engine = _engine(tiny_llama)
    cold = _engine(tiny_llama, enable_prefix_caching=False)
    talk = Conversation(engine, "ten")
    for i, text in enumerate(USERS):
        out, prompt, prefilled, kept = talk.turn(text)
        assert out.outputs[0].token_ids == cold.generate([prompt], GREEDY)[0].outputs[0].token_ids
        if i == 0:
            assert prefilled == len(prompt)
        else:
            # The new tokens: the last reply's final token (sampled, never yet read by the model)
            # and the turn's own tokens; everything before was kept.
            assert prefilled == len(prompt) - kept + 1
            assert out.metrics.num_cached_tokens == kept - 1
    stats = engine.get_stats().sessions
    assert stats.sessions == 1 and stats.recomputes_total == {}
    assert stats.reused_tokens_total > 0


def test_the_history_plus_each_turn_renders_like_the_whole_conversation(tiny_llama):
    engine = _engine(tiny_llama)
    talk = Conversation(engine, "render")
    messages = []
    for text in USERS[:4]:
        prompt = talk.prompt(text)
        messages.append({"role": "user", "content": text})
        assert engine.tokenizer.decode(prompt, skip_special_tokens=False) == (
            engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        )
        out, _, _, _ = talk.turn(text)
        tokens = out.outputs[0].token_ids
        if tokens[-1] in engine.tokenizer.eos_token_ids:  # the template writes the reply's end itself
            tokens = tokens[:-1]
        reply = engine.tokenizer.decode(tokens, skip_special_tokens=False)
        messages.append({"role": "assistant", "content": reply})


def test_a_template_that_rewrites_earlier_turns_is_refused(tiny_llama, tmp_path):
    engine = _engine(tiny_llama)
    engine.tokenizer._chat_template_sources["default"] = "{{ messages[-1]['content'] }}"
    engine.tokenizer._chat_templates.clear()
    with pytest.raises(ChatTemplateError, match="message by message"):
        encode_turn(engine.tokenizer, [1, 2, 3], [{"role": "user", "content": "hi"}])


def test_an_aborted_turn_keeps_its_tokens_and_the_next_turn_continues_from_them(tiny_llama):
    engine = _engine(tiny_llama)
    talk = Conversation(engine, "cancel")
    talk.turn(USERS[0])
    prompt = talk.prompt(USERS[1])
    engine.add_request(
        "cancel-1",
        prompt,
        SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True),
        session=SessionRef("cancel", history_tokens=len(talk.history)),
    )
    made: list[int] = []
    while len(made) < 5:
        for out in engine.step():
            made = list(out.outputs[0].token_ids)
    engine.abort_request("cancel-1")
    (aborted,) = engine.step()
    assert aborted.outputs[0].finish_reason == "abort"
    talk.history = prompt + list(aborted.outputs[0].token_ids)
    kept_history = list(talk.history)
    # No new message: the cut reply goes on where it stopped, computing only its last token.
    out, resumed, prefilled, _ = talk.turn(None)
    assert resumed == kept_history and prefilled == 1
    cold = _engine(tiny_llama, enable_prefix_caching=False)
    assert out.outputs[0].token_ids == cold.generate([resumed], GREEDY)[0].outputs[0].token_ids


def test_ending_a_session_returns_the_kv_to_idle(tiny_llama):
    engine = _engine(tiny_llama)
    talk = Conversation(engine, "end")
    for text in USERS[:3]:
        talk.turn(text)
    stats = engine.get_stats()
    assert stats.kv_session_blocks > 0 and stats.kv_used_blocks == 0  # kept KV is cached, not used
    assert stats.kv_cached_blocks >= stats.kv_session_blocks
    assert engine.end_session("end")
    stats = engine.get_stats()
    assert stats.kv_used_blocks == stats.kv_session_blocks == 0
    assert stats.kv_free_blocks + stats.kv_cached_blocks == stats.kv_num_blocks
    assert engine.get_stats().sessions.sessions == 0
    assert not engine.end_session("end")


def test_ending_a_session_mid_turn_aborts_the_turn_and_frees_it(tiny_llama):
    engine = _engine(tiny_llama)
    idle = engine.get_stats().kv_used_blocks
    engine.add_request(
        "mid-0", [5, 6, 7, 8], SamplingParams(max_tokens=100, ignore_eos=True), session=SessionRef("mid")
    )
    engine.step()
    assert engine.end_session("mid")
    outs = engine.step()
    assert outs[0].outputs[0].finish_reason == "abort"
    assert not engine.has_unfinished_requests()
    assert engine.get_stats().kv_used_blocks == idle


def test_idle_sessions_expire(tiny_llama):
    engine = _engine(tiny_llama)
    talk = Conversation(engine, "idle", idle_seconds=30.0)
    talk.turn(USERS[0])
    assert engine.expire_sessions() == []
    now = engine.sessions.clock()
    assert engine.sessions.expired(now + 31.0) == ["idle"]
    engine.sessions.clock = lambda: now + 31.0
    assert engine.expire_sessions() == ["idle"]
    assert engine.get_stats().kv_used_blocks == engine.get_stats().kv_session_blocks == 0


def test_kv_pressure_evicts_idle_sessions_first_and_their_next_turn_recomputes(tiny_llama):
    # 24 usable blocks of 16 tokens: three conversations of ~100 tokens each cannot all stay.
    engine = _engine(tiny_llama, num_blocks=25, max_model_len=256)
    cold = _engine(tiny_llama, enable_prefix_caching=False)
    talks = [Conversation(engine, f"s{i}") for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for round_ in range(3):
        for i, talk in enumerate(talks):
            text = f"conversation {i} round {round_}: " + "word " * 8
            out, prompt, _, _ = talk.turn(text, params)
            assert out.outputs[0].token_ids == cold.generate([prompt], params)[0].outputs[0].token_ids
    stats = engine.get_stats()
    assert stats.sessions.evictions_total > 0
    assert stats.sessions.recomputes_total.get("evicted", 0) > 0
    assert stats.num_preemptions_total == 0  # idle sessions went first


def test_a_new_session_over_the_limit_is_refused(tiny_llama):
    engine = _engine(tiny_llama, max_sessions=1)
    Conversation(engine, "one").turn(USERS[0])
    with pytest.raises(SessionLimitError, match="EXPERT_MAX_SESSIONS=1"):
        engine.add_request("two-0", [5, 6, 7], GREEDY, session=SessionRef("two"))
    assert not engine.has_unfinished_requests()


def test_a_second_turn_while_one_runs_is_refused(tiny_llama):
    engine = _engine(tiny_llama)
    engine.add_request("busy-0", [5, 6, 7], SamplingParams(max_tokens=20), session=SessionRef("busy"))
    with pytest.raises(SessionBusyError, match="already generating"):
        engine.add_request("busy-1", [5, 6, 7, 8], GREEDY, session=SessionRef("busy"))
    engine.abort_request("busy-0")
    engine.step()


def test_a_session_turn_has_one_output(tiny_llama):
    from libs.engine import InvalidRequestError

    engine = _engine(tiny_llama)
    with pytest.raises(InvalidRequestError, match=r"^n: a session turn has one output"):
        engine.add_request("n-0", [5, 6, 7], SamplingParams(n=2), session=SessionRef("n"))


def test_a_turn_with_a_session_limit_has_its_reply_cut_to_what_the_limit_leaves(tiny_llama):
    engine = _engine(tiny_llama)
    prompt = list(range(5, 25))
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    out = _run(engine, "cut-0", prompt, params, SessionRef("cut", max_tokens=30))
    assert len(out.outputs[0].token_ids) == 10 and out.outputs[0].finish_reason == "length"


def test_a_turn_without_a_session_limit_has_its_max_tokens_checked_as_any_requests(tiny_llama):
    from libs.engine import InvalidRequestError

    engine = _engine(tiny_llama, max_model_len=64)
    params = SamplingParams(max_tokens=100)
    with pytest.raises(InvalidRequestError, match=r"^max_tokens: prompt \(20 tokens\) \+ max_tokens"):
        engine.add_request("free-0", list(range(5, 25)), params, session=SessionRef("free"))
    request = engine.prepare_request(
        "window-0", list(range(5, 25)), params, session=SessionRef("window", max_tokens=0)
    )
    assert request.params.max_tokens == 44  # limit 0: the context window


def test_a_turn_its_session_limit_leaves_no_room_for_is_refused_before_it_is_queued(tiny_llama):
    engine = _engine(tiny_llama)
    with pytest.raises(SessionFullError, match=r"EXPERT_SESSION_MAX_TOKENS \(20\) leaves no room"):
        engine.add_request("full-0", list(range(5, 25)), GREEDY, session=SessionRef("full", max_tokens=20))
    assert not engine.has_unfinished_requests() and "full" not in engine.sessions


def test_a_session_limit_needs_the_turns_token_ids(tiny_llama):
    from libs.engine import InvalidRequestError

    engine = _engine(tiny_llama)
    with pytest.raises(InvalidRequestError, match=r"^prompt: a session turn with a token limit"):
        engine.add_request("text-0", "Hello", GREEDY, session=SessionRef("text", max_tokens=100))


def _kv_partition(engine: LLMEngine) -> tuple[set[int], set[int]]:
    """The blocks live sequences hold, and those only idle sessions hold, from the tables themselves."""
    live = {b for seq in engine._seqs.values() for b in seq.block_table}
    kept = {b for s in engine.sessions._sessions.values() if s.parked for b in s.parked.block_table}
    return live, kept - live


def test_many_sessions_sharing_a_system_prompt_count_each_kept_block_once(tiny_llama):
    # Issue 34: after first turns of 256 sessions with one system prompt, the load report said
    # kv_blocks_free 1,710 of kv_blocks_total 1,455: the shared prompt's blocks were counted once
    # per session. 3 shared full blocks and 1 block of each session's own: 259 distinct blocks.
    engine = _engine(tiny_llama, num_blocks=400, max_num_seqs=256, max_sessions=256)
    system = [5 + i % 40 for i in range(48)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    def first_turn(i: int) -> None:
        engine.add_request(
            f"s{i}-0", [*system, 100 + i % 200, 50 + i // 200, 7, 8], params, session=SessionRef(f"s{i}")
        )

    first_turn(0)
    while engine.has_unfinished_requests():
        engine.step()
    for i in range(1, 256):
        first_turn(i)
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.get_stats()
    load = EngineLoad.of(stats, engine.model_info)
    live, kept = _kv_partition(engine)
    assert load.sessions == 256 and not live
    assert load.kv_blocks_free <= load.kv_blocks_total and load.kv_blocks_sessions <= load.kv_blocks_total
    assert load.kv_blocks_sessions == len(kept) == 3 + 256
    assert load.kv_blocks_used == 0
    assert load.kv_blocks_free + load.kv_blocks_used + load.kv_blocks_cached == load.kv_blocks_total
    assert load.kv_blocks_available == load.kv_blocks_total  # idle sessions give theirs up on demand
    assert (load.max_sessions, load.kv_blocks_total) == (engine.model_info.max_sessions, 399)

    # A running request on the same system prompt: its shared blocks are used, not cached, once.
    engine.add_request("stateless", [*system, 9, 9, 9], params)
    engine.step()
    load = EngineLoad.of(engine.get_stats(), engine.model_info)
    live, kept = _kv_partition(engine)
    assert (load.kv_blocks_used, load.kv_blocks_sessions) == (len(live), len(kept)) == (4, 256)
    assert load.kv_blocks_free + load.kv_blocks_used + load.kv_blocks_cached == load.kv_blocks_total


def test_a_turn_under_other_experts_does_not_reuse_the_kept_kv(tiny_llama):
    engine = _engine(tiny_llama)
    talk = Conversation(engine, "adapters")
    talk.turn(USERS[0])
    engine.sessions._sessions["adapters"].parked.adapter_key = b"another expert"  # as if it had run under one
    reused = engine.get_stats().sessions.reused_tokens_total
    talk.turn(USERS[1])
    stats = engine.get_stats().sessions
    assert stats.reused_tokens_total == reused
    assert stats.recomputes_total == {"diverged": 1}
