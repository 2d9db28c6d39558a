"""The prompt-side rules of retrieval that need no encoder: sentence splitting, the request without
its material, the author's words and the topic probes."""

from __future__ import annotations

import math

import pytest

from libs.config import ConfigError
from services.router.config import RouterConfig
from services.router.matching import (
    MAX_SENTENCES,
    PROBED_KEYWORDS,
    SENTENCE_MARGIN,
    TOPIC_TEMPLATES,
    AuthorWords,
    MatchRule,
    PromptQuery,
    instruction,
    sentences,
    stems,
    topic_probes,
)


def test_a_one_sentence_prompt_has_no_sentences_of_its_own():
    assert sentences("Convert 5 miles to kilometres.") == []
    assert sentences("Convert 5 miles. Ok.") == []  # "Ok." is too short to stand alone


def test_sentences_split_on_end_marks_colons_and_newlines():
    prompt = "We moved offices last week. Can you help?\nConvert this: 12 miles to km!"
    expected = ["We moved offices last week.", "Can you help?", "Convert this:", "12 miles to km!"]
    assert sentences(prompt) == expected


def test_at_most_max_sentences_are_kept():
    prompt = " ".join(f"Sentence number {i} is here." for i in range(20))
    assert len(sentences(prompt)) == MAX_SENTENCES


def test_the_request_is_the_prompt_less_the_material_it_carries():
    request = "Could you boil this down?"
    assert instruction(f"{request}\n\nThe council met on Tuesday.") == request
    assert instruction("Summarise the policy:\nEmployees book flights.") == "Summarise the policy:"
    quoted = "Is this feedback good or bad? 'Never ordering from here again, it came cold.'"
    assert instruction(quoted) == "Is this feedback good or bad? this text"
    # An apostrophe opens no quotation; a prompt with no material has no request of its own.
    assert instruction("Strip out the candidate's email and phone: 'Ahmed | a@b.com | 555 123'") == (
        "Strip out the candidate's email and phone: this text"
    )
    assert instruction("Convert 5 miles to kilometres.") is None
    assert instruction("Hi\n\nthere") is None  # too short to stand alone


def test_words_are_compared_by_stem_without_stop_words_numbers_or_single_letters():
    assert stems("Summarise these emails, please") == stems("summarize email") == {"summar", "email"}
    assert stems("Replace it with [EMAIL] in 3 m") == {"replac", "[email]"}
    assert stems("the summaries") == stems("summary")


def test_rarer_author_words_weigh_more():
    generic = [stems("How do I write a good email to my boss?"), stems("Is email safe?")]
    words = AuthorWords(
        {
            "redact": "Replaces email addresses with [EMAIL]. redact, privacy",
            "writer": "Drafts polite emails and letters. email, letter",
        },
        generic,
    )
    found = words.matches("Redact the emails here with [EMAIL].")
    assert set(found) == {"redact", "writer"}
    assert found["redact"].words[-1] == "email"  # rarest first: "email" is the most common
    # "email" is in both experts' texts and in both generic prompts: ln(4 / 4) = 0.
    assert found["writer"].weight == pytest.approx(0.0)
    assert found["redact"].weight == pytest.approx(math.log(4) + math.log(4))  # "redact", "[email]"
    assert words.matches("What a lovely day") == {}
    assert AuthorWords({}, generic).matches("anything") == {}


def test_topic_probes_ask_about_each_of_the_first_keywords():
    probes = topic_probes(["regex", "pattern"])
    assert len(probes) == 2 * len(TOPIC_TEMPLATES)
    assert "Who invented regex?" in probes and "Who invented pattern?" in probes
    assert len(topic_probes([f"k{i}" for i in range(30)])) == PROBED_KEYWORDS * len(TOPIC_TEMPLATES)
    assert topic_probes([]) == []


def test_the_rules_come_from_the_environment_and_bad_values_name_the_variable():
    assert RouterConfig.from_env({}).matching == MatchRule()
    env = {
        "EXPERT_ROUTER_WORD_WEIGHT": "0",
        "EXPERT_ROUTER_TOPIC_GATE": "false",
        "EXPERT_ROUTER_COMPANION_RATIO": "0",
    }
    expected = MatchRule(word_weight=0.0, topic_gate=False, companion_ratio=0.0)
    assert RouterConfig.from_env(env).matching == expected
    for name, value in (
        ("EXPERT_ROUTER_WORD_WEIGHT", "2"),
        ("EXPERT_ROUTER_TOPIC_GATE", "maybe"),
        ("EXPERT_ROUTER_COMPANION_RATIO", "-1"),
    ):
        with pytest.raises(ConfigError, match=name):
            RouterConfig.from_env({name: value})


def test_a_sentence_must_beat_the_whole_prompt_by_its_margin():
    import torch

    query = PromptQuery("a. b.", torch.eye(3))  # rows: the whole prompt and two sentences
    experts = torch.tensor([[0.5, 0.55, 0.0], [0.2, 0.0, 0.9]])
    reached, rows = query.best(experts)
    assert rows.tolist() == [0, 2]  # 0.55 - margin < 0.5: the whole prompt's cosine stands
    assert reached.tolist() == pytest.approx([0.5, 0.9 - SENTENCE_MARGIN])
    assert (query.margin(0), query.margin(2)) == (0.0, SENTENCE_MARGIN)


def test_the_request_row_counts_like_the_whole_prompt():
    import torch

    query = PromptQuery("x", torch.eye(4), num_requests=2)  # the whole prompt, the request, 2 sentences
    experts = torch.tensor([[0.1, 0.6, 0.0, 0.0], [0.0, 0.0, 0.0, 0.9]])
    reached, rows = query.best(experts)
    assert rows.tolist() == [1, 3] and reached.tolist() == pytest.approx([0.6, 0.9 - SENTENCE_MARGIN])
    assert [query.source(r) for r in range(4)] == ["whole prompt", "request", "sentence 1", "sentence 2"]
