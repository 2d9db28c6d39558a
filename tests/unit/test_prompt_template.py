"""Request templates: one-pass substitution of {prompt} and {body}, and the rendered length known
without rendering."""

from __future__ import annotations

import pytest

from libs.prompt_template import DEFAULT_BODY_TEMPLATE, render_template, rendered_length


@pytest.mark.parametrize(
    ("template", "prompt", "body", "expected"),
    [
        ("Q: {prompt}", "hi", "", "Q: hi"),
        (DEFAULT_BODY_TEMPLATE, "Sum up", "text", "Sum up\n\ntext"),
        ('{"a": {prompt}} {body}{body}', "1", "x", '{"a": 1} xx'),  # other braces are literal
        ("{prompt}", "{body}", "never", "{body}"),  # substituted text is not substituted again
        ("{prompt", "p", "b", "{prompt"),
    ],
)
def test_render_substitutes_each_placeholder_once(template, prompt, body, expected):
    assert render_template(template, prompt, body) == expected
    assert rendered_length(template, prompt, body) == len(expected)


def test_the_length_of_a_huge_expansion_is_known_without_building_it():
    assert rendered_length("{prompt}" * 1000, "p" * 100_000, "") == 100_000_000
