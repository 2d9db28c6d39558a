"""The engine's tokenizer: text <-> ids, special tokens, stop ids and the chat template of a checkpoint."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _Backend

from libs.utf8 import surrogate_problem

from .chat_template import ChatTemplate, ChatTemplateError
from .checkpoint import TokenizerError, load_tokenizer_files

__all__ = ["Tokenizer", "TokenizerError", "UnencodableTextError"]

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a byte-fallback token


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: printable bytes stand for themselves, the
    others for the characters from U+0100 on, in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(0x100 + n): b for n, b in enumerate(others)}


_BYTE_LEVEL = _byte_level_alphabet()


def _decoder_types(state: Any) -> set[str]:
    """Every decoder type named in a decoder's JSON, those inside a Sequence included."""
    if isinstance(state, Mapping):
        return {state.get("type"), *(t for d in state.get("decoders") or () for t in _decoder_types(d))}
    return set()


class UnencodableTextError(ValueError):
    """Text the tokenizer cannot take: it holds a lone surrogate, which UTF-8 cannot encode. The
    caller's input is to blame, never the engine."""


class Tokenizer:
    """Text <-> token ids for one checkpoint, plus its special tokens, stop ids and chat template.

    Build it with `Tokenizer.from_dir(path)`; everything is parsed once there, so `encode` and
    `decode` are single calls into the Rust backend. Safe to share across threads for reading.
    """

    def __init__(
        self,
        backend: _Backend,
        *,
        special_tokens: Mapping[str, str] | None = None,
        extra_special_tokens: Sequence[str] = (),
        chat_templates: Mapping[str, str] | None = None,
        stop_token_ids: Iterable[int] = (),
        clean_up_tokenization_spaces: bool = False,
    ) -> None:
        # The engine always wants the whole prompt; a truncation or padding baked into tokenizer.json
        # would silently cut or pad it.
        backend.no_truncation()
        backend.no_padding()
        self._backend = backend
        self._special_tokens = dict(special_tokens or {})
        self._token_ids = {key: backend.token_to_id(token) for key, token in self._special_tokens.items()}
        specials = list(dict.fromkeys([*self._special_tokens.values(), *extra_special_tokens]))
        self._all_special_ids = [i for i in map(backend.token_to_id, specials) if i is not None]
        # Compiled on first use: a template that does not compile must not stop plain-text prompts.
        self._chat_template_sources = dict(chat_templates or {})
        self._chat_templates: dict[str, ChatTemplate] = {}
        eos_id = self._token_ids.get("eos_token")
        self._eos_token_ids = frozenset([*stop_token_ids, *([] if eos_id is None else [eos_id])])
        # The ids `decode(skip_special_tokens=True)` leaves out: the added tokens marked special.
        self._skipped_ids = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
        self._control_token_ids = self._eos_token_ids.union(self._all_special_ids, self._skipped_ids)
        decoder = backend.decoder
        types = _decoder_types(json.loads(decoder.__getstate__())) if decoder is not None else set()
        self._byte_level = "ByteLevel" in types
        self._byte_fallback = "ByteFallback" in types
        # transformers skips this WordPiece-era cleanup for BPE models because it corrupts their text.
        self._clean_up = clean_up_tokenization_spaces and type(backend.model).__name__ != "BPE"

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load from an HF checkpoint directory; raises TokenizerError naming the bad file or field."""
        return cls(**vars(load_tokenizer_files(path)))

    @property
    def backend(self) -> _Backend:
        """The underlying `tokenizers.Tokenizer` (read-only use, please)."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (the model's embedding may be padded beyond it)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self._token_ids.get("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._token_ids.get("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._token_ids.get("pad_token")

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Ids that end generation: generation_config's and config's eos_token_id plus the eos token."""
        return self._eos_token_ids

    @property
    def control_token_ids(self) -> frozenset[int]:
        """The ids that structure text rather than say something: the eos ids, the named and extra
        special tokens and every added token marked special (a chat template's `<|im_start|>`,
        `<|im_end|>`, ...). No repetition, presence or frequency penalty touches them."""
        return self._control_token_ids

    @property
    def special_tokens(self) -> dict[str, str]:
        """Named special tokens as text, e.g. {"bos_token": "<s>", "eos_token": "</s>"}."""
        return dict(self._special_tokens)

    @property
    def all_special_ids(self) -> list[int]:
        """Ids of the named and extra special tokens, in transformers' order."""
        return list(self._all_special_ids)

    @property
    def chat_template(self) -> str | None:
        """The default chat template's source, or None when the checkpoint has none."""
        return self._chat_template_sources.get("default")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` applies the post-processor (e.g. a leading bos).
        Raises UnencodableTextError for text UTF-8 cannot hold (the backend would raise a bare
        TypeError, "TextInputSequence must be str", that names nothing)."""
        problem = surrogate_problem(text) if isinstance(text, str) else None
        if problem is not None:
            raise UnencodableTextError(problem)
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(
        self,
        ids: Sequence[int],
        skip_special_tokens: bool = True,
        clean_up_tokenization_spaces: bool | None = None,
    ) -> str:
        """Text of `ids`; cleanup of spaces before punctuation follows the checkpoint unless overridden."""
        text = self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        clean_up = self._clean_up if clean_up_tokenization_spaces is None else clean_up_tokenization_spaces
        return _clean_up_tokenization(text) if clean_up else text

    def token_bytes(self, token_id: int, skip_special_tokens: bool = True) -> bytes | None:
        """The bytes a token adds to the decoded text, for the tokens whose text can end inside a
        UTF-8 character: every token of a byte-level decoder and the `<0xNN>` tokens of a byte-fallback
        one (b"" for a special token that decoding skips). None for a token that always decodes to
        whole characters, or under a decoder of another kind."""
        if skip_special_tokens and token_id in self._skipped_ids:
            return b""
        token = self._backend.id_to_token(token_id)
        if token is None:
            return None
        if self._byte_level:
            # As the ByteLevel decoder does: a token outside the alphabet (an added token) is its UTF-8.
            raw = [_BYTE_LEVEL.get(char) for char in token]
            return token.encode() if None in raw else bytes(raw)
        if self._byte_fallback and (match := _BYTE_TOKEN.fullmatch(token)):
            return bytes([int(match[1], 16)])
        return None

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        """Vocabulary strings of `ids` (None for an id outside the vocabulary)."""
        return [self._backend.id_to_token(i) for i in ids]

    def template_source(self, *, tools: bool = False) -> str | None:
        """The source of the template `apply_chat_template` renders with: the "tool_use" one when
        tools are given and the checkpoint has one, else the default (None: no template)."""
        sources = self._chat_template_sources
        if tools and "tool_use" in sources:
            return sources["tool_use"]
        return sources.get("default")

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        """Render a conversation to prompt text, as transformers' `apply_chat_template(tokenize=False)`.

        The template sees the named special tokens (`bos_token`, `eos_token`, ...) and `extra`;
        a "tool_use" template is preferred when `tools` are given and the checkpoint has one.
        """
        template = self._chat_template("tool_use" if tools is not None else "default")
        variables = {**self._special_tokens, **extra}
        return template.render(
            messages, add_generation_prompt=add_generation_prompt, tools=tools, **variables
        )

    def _chat_template(self, name: str) -> ChatTemplate:
        sources = self._chat_template_sources
        if name not in sources:
            name = "default"
        if name not in sources:
            if sources:
                raise ChatTemplateError(
                    f"chat_template: no 'default' template among {', '.join(sorted(sources))}"
                )
            raise ChatTemplateError("chat_template: this checkpoint has no chat template")
        if name not in self._chat_templates:
            self._chat_templates[name] = ChatTemplate(sources[name])
        return self._chat_templates[name]

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **extra: Any,
    ) -> list[int]:
        """Prompt ids of a conversation; the template writes its own special tokens, so none are added."""
        text = self.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tools=tools, **extra
        )
        return self.encode(text, add_special_tokens=False)


def _clean_up_tokenization(text: str) -> str:
    for before, after in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(before, after)
    return text
