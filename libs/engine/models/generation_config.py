"""The sampling a checkpoint recommends: the sampling values of its generation_config.json.

Model authors put the temperature, top_p, top_k and repetition penalty their model was tuned for
there (Qwen2.5-Instruct: 0.7, 0.8, 20, 1.05); vLLM serves them as the defaults of a request that
does not set its own. Only those four are read: `do_sample` is ignored as vLLM ignores it (a
request asks for greedy decoding with temperature 0), and the token ids are the tokenizer's business.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from libs.engine.models.errors import CheckpointError

GENERATION_CONFIG_FILE = "generation_config.json"
# field -> (type, whether a value is in range); a value out of range is a broken file, not a default.
_FIELDS = {
    "temperature": (float, lambda v: v >= 0.0),
    "top_p": (float, lambda v: 0.0 < v <= 1.0),
    "top_k": (int, lambda v: v >= 0 and float(v).is_integer()),  # 0: off
    "repetition_penalty": (float, lambda v: v > 0.0),
}


def sampling_defaults(model_dir: str | Path) -> dict[str, float | int]:
    """The sampling values `model_dir`'s generation_config.json sets (an empty dict without the file)."""
    path = Path(model_dir) / GENERATION_CONFIG_FILE
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: not readable JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    defaults: dict[str, float | int] = {}
    for name, (kind, in_range) in _FIELDS.items():
        value = data.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise CheckpointError(f"{path}: {name} must be a number, got {value!r}")
        if not in_range(value):
            raise CheckpointError(f"{path}: {name} out of range: {value!r}")
        defaults[name] = kind(value)
    return defaults
