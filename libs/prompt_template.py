"""Request templates: `{prompt}` and `{body}` substituted into a request's `template`.

Reception bounds the rendered length before a job is queued and the router renders the model's
input, so both take the rule from here. Substitution is one pass over the template: a prompt that
itself holds "{body}" stays as written, and the rendered length is known without rendering.
"""

from __future__ import annotations

import re

DEFAULT_BODY_TEMPLATE = "{prompt}\n\n{body}"
_PLACEHOLDER = re.compile(r"\{(prompt|body)\}")


def render_template(template: str, prompt: str, body: str) -> str:
    """Substitute {prompt} and {body}; every other brace is literal (templates often hold JSON)."""
    values = {"prompt": prompt, "body": body}
    return _PLACEHOLDER.sub(lambda match: values[match.group(1)], template)


def rendered_length(template: str, prompt: str, body: str) -> int:
    """The length in characters of render_template(template, prompt, body), without building it."""
    prompts = bodies = 0
    for match in _PLACEHOLDER.finditer(template):
        if match.group(1) == "prompt":
            prompts += 1
        else:
            bodies += 1
    return (
        len(template)
        - prompts * len("{prompt}")
        - bodies * len("{body}")
        + prompts * len(prompt)
        + bodies * len(body)
    )
