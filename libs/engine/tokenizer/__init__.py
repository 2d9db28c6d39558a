"""The engine's text layer: tokenizer, chat templates and streaming detokenization (no torch here)."""

from .chat_template import ROLES, ChatTemplate, ChatTemplateError, validate_messages
from .checkpoint import TokenizerError
from .detokenizer import IncrementalDetokenizer, StopStringMatcher, TextDelta, TextStream
from .tokenizer import Tokenizer, UnencodableTextError

__all__ = [
    "ROLES",
    "ChatTemplate",
    "ChatTemplateError",
    "IncrementalDetokenizer",
    "StopStringMatcher",
    "TextDelta",
    "TextStream",
    "Tokenizer",
    "TokenizerError",
    "UnencodableTextError",
    "validate_messages",
]
