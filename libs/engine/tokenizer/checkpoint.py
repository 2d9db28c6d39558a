"""Reading the text-side files of an HF checkpoint directory, the way transformers (v5) reads them.

What `PreTrainedTokenizerFast.from_pretrained` does for these files is the reference, so ids and
text match it exactly: special tokens come from tokenizer_config.json (strings or AddedToken dicts;
its `added_tokens_decoder` flags win over tokenizer.json's), missing ones are appended to the
vocabulary, and the tokenizer.json post-processor alone decides which special tokens `encode`
adds (transformers drops `add_bos_token`/`add_eos_token` whenever tokenizer.json exists). The stop
ids gather every eos id the checkpoint declares.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as _Backend

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
STOP_ID_FILES = ("generation_config.json", "config.json")

# transformers' named special tokens, in the order its `all_special_ids` lists them.
NAMED_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
_ADDED_TOKEN_FIELDS = ("content", "single_word", "lstrip", "rstrip", "normalized", "special")


class TokenizerError(ValueError):
    """A checkpoint's tokenizer files are missing or malformed; the message names the file and field."""


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"{path}: not readable JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object")
    return data


def _added_token(value: Any, where: str, *, special: bool | None = True) -> AddedToken:
    """A str or an AddedToken dict as transformers serializes it; `special` overrides the dict's flag."""
    if isinstance(value, str):
        return AddedToken(value, special=bool(special), normalized=False)
    if isinstance(value, Mapping):
        if not isinstance(value.get("content"), str):
            raise TokenizerError(f"{where}.content: expected a string")
        fields = {key: value[key] for key in _ADDED_TOKEN_FIELDS if key in value}
        if special is not None:
            fields["special"] = special
        try:
            return AddedToken(**fields)
        except TypeError as exc:  # a flag that is not a bool
            raise TokenizerError(f"{where}: {exc}") from exc
    raise TokenizerError(f"{where}: expected a string or an AddedToken object, got {type(value).__name__}")


def _is_token_value(value: Any) -> bool:
    return isinstance(value, str) or (isinstance(value, Mapping) and value.get("__type") == "AddedToken")


def _token_ids(value: Any, where: str) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise TokenizerError(f"{where}: expected a token id or a list of token ids, got {value!r}")
    return list(values)


def _load_special_tokens(
    config: dict[str, Any], backend: _Backend, where: str
) -> tuple[dict[str, str], list[str]]:
    """Register the config's special tokens in `backend` the way transformers does; return their names."""
    config_added = _config_added_tokens(config, where)
    by_content = {token.content: token for token in config_added}
    named = _named_tokens(config, by_content, where)
    extras_raw = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
    if isinstance(extras_raw, Mapping):
        named.update(
            {key: _added_token(v, f"{where}: extra_special_tokens.{key}") for key, v in extras_raw.items()}
        )
        extras_raw = []
    if not isinstance(extras_raw, list):
        raise TokenizerError(f"{where}: extra_special_tokens: expected a list of tokens")
    extras = [_added_token(v, f"{where}: extra_special_tokens[{i}]") for i, v in enumerate(extras_raw)]
    _register_tokens(backend, config_added, named, extras)
    return {key: token.content for key, token in named.items()}, [token.content for token in extras]


def _config_added_tokens(config: dict[str, Any], where: str) -> list[AddedToken]:
    """The tokens of the config's `added_tokens_decoder`, in id order, with their own flags."""
    decoder = config.get("added_tokens_decoder") or {}
    if not isinstance(decoder, Mapping):
        raise TokenizerError(f"{where}: added_tokens_decoder: expected an object of id -> token")
    for key in decoder:
        if not str(key).isdigit():
            raise TokenizerError(f"{where}: added_tokens_decoder.{key}: expected an integer token id as key")
    return [
        _added_token(decoder[key], f"{where}: added_tokens_decoder.{key}", special=None)
        for key in sorted(decoder, key=int)
    ]


def _named_tokens(
    config: dict[str, Any], by_content: dict[str, AddedToken], where: str
) -> dict[str, AddedToken]:
    """The named special tokens (`bos_token`, … and any other `*_token`), as the added token of the
    same content when the decoder has one."""
    named_keys = [key for key in NAMED_SPECIAL_TOKENS if config.get(key) is not None]
    named_keys += [
        key
        for key, value in config.items()
        if key.endswith("_token") and key not in NAMED_SPECIAL_TOKENS and _is_token_value(value)
    ]
    named = {key: _added_token(config[key], f"{where}: {key}") for key in named_keys}
    return {key: by_content.get(token.content, token) for key, token in named.items()}


def _register_tokens(
    backend: _Backend, config_added: list[AddedToken], named: dict[str, AddedToken], extras: list[AddedToken]
) -> None:
    # transformers re-adds every config token (so the config's lstrip/rstrip flags win), then the
    # special tokens the vocabulary lacks; any named token is forced special.
    known = {token.content for token in backend.get_added_tokens_decoder().values()}
    known.update(token.content for token in config_added)
    to_add = list(config_added)
    for token in [*named.values(), *extras]:
        if token.content not in known and all(token.content != t.content for t in to_add):
            to_add.append(token)
    named_contents = {token.content for token in named.values()}
    for token in to_add:
        if token.content in named_contents and not token.special:
            token.special = True
    if to_add:
        backend.add_tokens(to_add)


def _load_chat_templates(directory: Path, config: dict[str, Any]) -> dict[str, str]:
    templates: dict[str, str] = {}
    if (directory / CHAT_TEMPLATE_FILE).is_file():
        templates["default"] = (directory / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    if (directory / CHAT_TEMPLATE_DIR).is_dir():
        for path in sorted((directory / CHAT_TEMPLATE_DIR).glob("*.jinja")):
            templates[path.stem] = path.read_text(encoding="utf-8")
    if templates:
        return templates
    raw = config.get("chat_template")
    where = f"{TOKENIZER_CONFIG_FILE}: chat_template"
    if raw is None:
        return {}
    if isinstance(raw, str):
        return {"default": raw}
    if not isinstance(raw, list):
        raise TokenizerError(f"{where}: expected a string or a list of {{name, template}} objects")
    for i, item in enumerate(raw):
        if not (
            isinstance(item, Mapping)
            and isinstance(item.get("name"), str)
            and isinstance(item.get("template"), str)
        ):
            raise TokenizerError(f"{where}[{i}]: expected an object with string 'name' and 'template'")
        templates[item["name"]] = item["template"]
    return templates


@dataclass(frozen=True)
class TokenizerFiles:
    """Everything a Tokenizer is built from, parsed and validated."""

    backend: _Backend
    special_tokens: dict[str, str]
    extra_special_tokens: list[str]
    chat_templates: dict[str, str]
    stop_token_ids: list[int]
    clean_up_tokenization_spaces: bool


def load_tokenizer_files(path: str | Path) -> TokenizerFiles:
    """Parse a checkpoint directory's tokenizer files; raises TokenizerError naming the bad file or field."""
    directory = Path(path)
    tokenizer_file = directory / TOKENIZER_FILE
    if not tokenizer_file.is_file():
        raise TokenizerError(
            f"{tokenizer_file}: missing; the engine needs a tokenizers-format {TOKENIZER_FILE}"
        )
    try:
        backend = _Backend.from_file(str(tokenizer_file))
    except Exception as exc:  # the Rust loader raises a bare Exception for every parse error
        raise TokenizerError(f"{tokenizer_file}: cannot be loaded: {exc}") from exc

    config = _read_json(directory / TOKENIZER_CONFIG_FILE) or {}
    if "added_tokens_decoder" not in config:
        # Older checkpoints keep their special tokens in special_tokens_map.json instead.
        for key, value in (_read_json(directory / SPECIAL_TOKENS_MAP_FILE) or {}).items():
            if key in ("additional_special_tokens", "extra_special_tokens") and config.get(key):
                continue
            config[key] = {**value, "__type": "AddedToken"} if isinstance(value, Mapping) else value
    special_tokens, extras = _load_special_tokens(config, backend, TOKENIZER_CONFIG_FILE)
    split_special = config.get("split_special_tokens", False)
    if not isinstance(split_special, bool):
        raise TokenizerError(f"{TOKENIZER_CONFIG_FILE}: split_special_tokens: expected true or false")
    backend.encode_special_tokens = split_special

    stop_ids: list[int] = []
    for name in STOP_ID_FILES:
        stop_ids += _token_ids(
            (_read_json(directory / name) or {}).get("eos_token_id"), f"{name}: eos_token_id"
        )
    return TokenizerFiles(
        backend=backend,
        special_tokens=special_tokens,
        extra_special_tokens=extras,
        chat_templates=_load_chat_templates(directory, config),
        stop_token_ids=stop_ids,
        clean_up_tokenization_spaces=bool(config.get("clean_up_tokenization_spaces", False)),
    )
