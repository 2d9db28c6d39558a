"""A session turn's token budget (libs/engine/sessions.py, `turn_max_tokens`): the reply gets what
the session's token limit leaves after the turn's prompt, or less when the turn asks for less; the
limit is the context window when the session sets none (0) or one past it; a turn that leaves
nothing is refused, naming the limit."""

from __future__ import annotations

import pytest

from libs.engine.sessions import SessionError, SessionFullError, turn_max_tokens

WINDOW = 1024


def test_the_reply_is_cut_to_what_the_session_limit_leaves():
    assert turn_max_tokens(500, 256, session_max_tokens=600, max_model_len=WINDOW) == 100


def test_a_reply_without_max_tokens_gets_all_the_session_limit_leaves():
    assert turn_max_tokens(500, None, session_max_tokens=600, max_model_len=WINDOW) == 100


def test_a_smaller_max_tokens_of_the_turn_stays():
    assert turn_max_tokens(500, 20, session_max_tokens=600, max_model_len=WINDOW) == 20


@pytest.mark.parametrize("session_max_tokens", [0, WINDOW, 4096])
def test_without_a_limit_below_it_the_context_window_bounds_the_session(session_max_tokens):
    assert turn_max_tokens(1000, None, session_max_tokens, max_model_len=WINDOW) == 24


def test_a_turn_that_leaves_no_room_is_refused_naming_the_session_limit():
    with pytest.raises(SessionFullError) as refused:
        turn_max_tokens(600, 8, session_max_tokens=600, max_model_len=WINDOW)
    assert str(refused.value) == (
        "the session holds 600 tokens with this turn, and EXPERT_SESSION_MAX_TOKENS (600) leaves no "
        "room for a reply: end it and start a new one"
    )
    assert isinstance(refused.value, SessionError)


def test_a_turn_past_the_context_window_is_refused_naming_it():
    with pytest.raises(
        SessionFullError, match=r"holds 1030 tokens .* the model's context window \(1024 tokens\)"
    ):
        turn_max_tokens(1030, None, session_max_tokens=0, max_model_len=WINDOW)
