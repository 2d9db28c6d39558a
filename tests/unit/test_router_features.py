"""The router's code feature: code as it is written counts, words about code do not."""

from __future__ import annotations

import pytest

from services.router.features import extract_features

PROSE = [
    "What is the capital of France?",
    "What is the function of the liver?",
    "Name a classic novel by Tolstoy.",
    "Why is it important to import fewer goods?",
    "My class schedule: Monday and Tuesday.",
    "Explain how a Python class works, in one sentence.",
    "from here to there",
]
CODE = [
    "Fix this:\n```\nprint(1)\n```",
    "import os\nprint(os.getcwd())",
    "from collections import Counter",
    "def area(r):\n    return 3.14 * r * r",
    "What does function add(a, b) { return a + b } return?",
    "class Point:\n    pass",
    "class Stack { constructor() {} }",
    "const f = (x) => x * 2",
    "#include <stdio.h>\nint main() { return 0; }",
    "int x = 3;\nx++;",
]


@pytest.mark.parametrize("prompt", PROSE)
def test_prose_that_names_code_words_has_no_code(prompt):
    assert not extract_features(prompt).has_code


@pytest.mark.parametrize("prompt", CODE)
def test_code_as_written_has_code(prompt):
    assert extract_features(prompt).has_code
