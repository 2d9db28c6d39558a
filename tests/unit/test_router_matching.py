"""The prompt-side rules of retrieval that need no encoder: sentence splitting, whole-word keyword
lookup and the topic probes."""

from __future__ import annotations

import pytest

from libs.config import ConfigError
from services.router.config import RouterConfig
from services.router.matching import (
    MAX_SENTENCES,
    PROBED_KEYWORDS,
    SENTENCE_MARGIN,
    TOPIC_TEMPLATES,
    KeywordIndex,
    MatchRule,
    PromptQuery,
    sentences,
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


def test_keywords_match_as_whole_words_in_any_case():
    keywords = KeywordIndex({"sql": ["SQL", "select statement"], "regex": ["regex"], "tldr": ["tl;dr"]})
    assert keywords.matches("Write an sql query") == {"sql": "SQL"}
    assert keywords.matches("I need a SELECT  statement, please") == {"sql": "select statement"}
    assert keywords.matches("mysql is a database") == {}  # not a whole word
    assert keywords.matches("regexes are hard") == {}
    assert keywords.matches("TL;DR this article; and write a regex.") == {"tldr": "tl;dr", "regex": "regex"}


def test_keywords_with_punctuation_and_shared_keywords():
    keywords = KeywordIndex({"cpp": ["C++"], "c": ["c"], "mail": ["e-mail"], "mail2": ["e-mail"]})
    assert keywords.matches("Port this to C++ now") == {"cpp": "C++", "c": "c"}
    assert keywords.matches("Send an e-mail.") == {"mail": "e-mail", "mail2": "e-mail"}
    assert KeywordIndex({}).matches("anything") == {}


def test_topic_probes_ask_about_each_of_the_first_keywords():
    probes = topic_probes(["regex", "pattern"])
    assert len(probes) == 2 * len(TOPIC_TEMPLATES)
    assert "Who invented regex?" in probes and "Who invented pattern?" in probes
    assert len(topic_probes([f"k{i}" for i in range(30)])) == PROBED_KEYWORDS * len(TOPIC_TEMPLATES)
    assert topic_probes([]) == []


def test_the_rules_come_from_the_environment_and_bad_values_name_the_variable():
    assert RouterConfig.from_env({}).matching == MatchRule()
    env = {
        "EXPERT_ROUTER_KEYWORD_BOOST": "0",
        "EXPERT_ROUTER_TOPIC_GATE": "false",
        "EXPERT_ROUTER_COMPANION_RATIO": "0",
    }
    expected = MatchRule(keyword_boost=0.0, topic_gate=False, companion_ratio=0.0)
    assert RouterConfig.from_env(env).matching == expected
    for name, value in (
        ("EXPERT_ROUTER_KEYWORD_BOOST", "2"),
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
