"""The tool-call format of a model family, told from its chat template.

A template that writes `<tool_call>` (Qwen2, Qwen2.5, Qwen3, Hermes) renders tools itself and
expects hermes-style calls; one with Llama 3.1's `<|python_tag|>`/`ipython` role renders tools
itself and expects Llama 3's bare JSON calls. Any other template (SmolLM2's, for one) knows nothing
of tools: the conversation is rewritten before it (libs/tools/rendering.py) and the calls are
hermes-style, which is what the rewritten system turn asks for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Format = Literal["hermes", "llama3_json"]


@dataclass(frozen=True)
class ToolFamily:
    """How a model is shown tools and how it calls them.

    format: hermes (`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per
    call, blocks separated by a newline) or llama3_json (`{"name": ..., "parameters": {...}}`,
    calls separated by `; `). native: the chat template renders tools, calls and results itself;
    otherwise the fallback rendering does.
    """

    format: Format
    native: bool

    @property
    def call_start(self) -> str:
        """What every call (so every tool-call output) starts with."""
        return "<tool_call>" if self.format == "hermes" else "{"


FALLBACK = ToolFamily("hermes", native=False)


def family_of(template_source: str | None) -> ToolFamily:
    """The family of a chat template (None: no template, the fallback)."""
    if not template_source:
        return FALLBACK
    if "<tool_call>" in template_source:
        return ToolFamily("hermes", native=True)
    if "<|python_tag|>" in template_source or ("ipython" in template_source and "tools" in template_source):
        return ToolFamily("llama3_json", native=True)
    return FALLBACK
