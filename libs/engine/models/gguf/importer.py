"""The conversion itself: check and plan everything from the GGUF first, then write the HF files into a
hidden staging directory that is renamed into place only once complete."""

from __future__ import annotations

import json
import os
import secrets
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from libs.engine.models.config import STORED_QUANT_METHOD
from libs.engine.models.gguf.config import generation_config, llama_config
from libs.engine.models.gguf.reader import GGUFImportError, Metadata, open_gguf
from libs.engine.models.gguf.tokenizer import build_tokenizer
from libs.engine.models.gguf.weights import tensor_plan, write_safetensors


def import_gguf(
    gguf_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    sampling: Mapping[str, float] | None = None,
    keep_quantized: bool = False,
) -> Path:
    """Convert the Llama-family GGUF at `gguf_path` into an HF checkpoint directory at `out_dir`.
    `sampling` (generation_config.json's names: temperature, top_p, top_k, repetition_penalty) is
    the recommended sampling to write for a file that does not carry its own. `keep_quantized`
    writes Q8_0 / Q4_0 / Q4_1 projections and LM head as they are (weights.py), for the engine to
    serve with exactly the file's weights.

    Everything is written into a hidden sibling directory that is renamed into place at the end, so
    an interrupted conversion never leaves a partial `out_dir`. An existing `out_dir` is an error
    unless `overwrite` is set. Returns the output directory.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise GGUFImportError(f"output directory {out_dir} already exists (use --force / overwrite=True)")
    if out_dir.exists() and not out_dir.is_dir():
        raise GGUFImportError(f"output path {out_dir} exists and is not a directory")
    meta = Metadata(open_gguf(gguf_path))
    architecture = meta.get("general.architecture")
    if architecture != "llama":
        raise GGUFImportError(
            f"unsupported architecture {architecture!r} in {gguf_path} (general.architecture); "
            "only 'llama' (Llama, Mistral, SmolLM, TinyLlama...) is supported"
        )
    config = llama_config(meta)
    plan = tensor_plan(meta, config, keep_quantized)
    if any(name.endswith(".qweight") for name, _, _, _ in plan):
        config = config | {"quantization_config": {"quant_method": STORED_QUANT_METHOD}}
    tokenizer, tokenizer_config = build_tokenizer(meta)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = _sibling(out_dir, "partial")
    try:
        write_safetensors(staging / "model.safetensors", plan)
        tokenizer.save(str(staging / "tokenizer.json"))
        _write_json(staging / "tokenizer_config.json", tokenizer_config)
        _write_json(staging / "generation_config.json", generation_config(meta, sampling))
        _write_json(staging / "config.json", config)
        _publish(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


def _write_json(path: Path, content: dict[str, Any]) -> None:
    path.write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _publish(staging: Path, out_dir: Path) -> None:
    """Rename the finished staging directory to `out_dir`, replacing an old one only once the new one
    is complete."""
    if not out_dir.exists():
        staging.rename(out_dir)
        return
    retired = _sibling(out_dir, "old")
    out_dir.rename(retired / out_dir.name)
    staging.rename(out_dir)
    shutil.rmtree(retired, ignore_errors=True)


def _sibling(out_dir: Path, role: str) -> Path:
    # mkdir (unlike mkdtemp's 0700) gives the directory the permissions the umask allows.
    path = out_dir.parent / f".{out_dir.name}.{role}-{os.getpid()}-{secrets.token_hex(4)}"
    path.mkdir()
    return path
