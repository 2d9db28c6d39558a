"""`expertctl expert train`: a PEFT adapter (and, asked for, a signed package) from a JSONL file.

Each line of the data is `{"prompt": ..., "completion": ...}` or `{"messages": [...]}`. Samples are
rendered with the base model's chat template exactly as the engine renders requests at serving time,
and only the answers carry loss. A share of the samples is held out to evaluate every epoch; training
stops early when the held-out loss stops improving and keeps the best epoch. The adapter is written to
`--out`; with `--name`, `--version`, `--description` and `--key` the same command also writes the
signed `.expert` package (`--package`, by default NAME-VERSION.expert beside `--out`), whose manifest
lists a sample of the training prompts as examples, so the router knows the expert by its data.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

from tools.expertctl.errors import UsageError
from tools.expertctl.metadata_options import add_metadata_options, metadata_from, split_list
from tools.expertctl.model_cmd import DEFAULT_MODEL_DIR

if TYPE_CHECKING:
    from libs.training.expert import PackageSpec
    from libs.training.trainer import TrainSettings

_PACKAGE_OPTIONS = ("name", "version", "description", "key")


def add_train(actions: argparse._SubParsersAction) -> None:
    """`expert train` (added to the `expert` command's actions)."""
    from libs.training.trainer import ADAPTER_TYPES, TrainSettings

    d = TrainSettings()
    train = actions.add_parser(
        "train", help="train a PEFT adapter on a JSONL file (and pack it)", description=__doc__
    )
    train.add_argument("data", metavar="DATA.jsonl", type=Path, help="the training samples")
    train.add_argument("--out", type=Path, required=True, metavar="DIR", help="where to write the adapter")
    train.add_argument(
        "--base",
        type=Path,
        default=DEFAULT_MODEL_DIR,
        metavar="DIR",
        help=f"the base model ({DEFAULT_MODEL_DIR})",
    )
    train.add_argument("--type", choices=ADAPTER_TYPES, default=d.adapter_type, help="the adapter (lora)")
    train.add_argument("--force", action="store_true", help="replace --out and --package if they exist")
    train.add_argument("--json", action="store_true", help="print the summary as JSON")
    _add_adapter_options(train.add_argument_group("adapter"), d)
    _add_training_options(train.add_argument_group("training"), d)
    _add_package_options(
        train.add_argument_group("package (all of --name, --version, --description and --key)")
    )
    train.set_defaults(handler=_train)


def _add_adapter_options(shape: argparse._ArgumentGroup, d: TrainSettings) -> None:
    shape.add_argument("--rank", type=int, default=d.rank, help=f"LoRA rank ({d.rank})")
    shape.add_argument("--alpha", type=float, default=d.alpha, help=f"LoRA alpha ({d.alpha:g})")
    shape.add_argument("--dropout", type=float, default=d.dropout, help=f"LoRA dropout ({d.dropout:g})")
    shape.add_argument(
        "--target-modules",
        metavar="A,B,...",
        help="modules to adapt (LoRA: every attention and MLP projection; IA3: peft's default for the model)",
    )
    shape.add_argument("--feedforward-modules", metavar="A,B,...", help="IA3 modules scaled at their input")
    shape.add_argument(
        "--virtual-tokens",
        type=int,
        default=d.num_virtual_tokens,
        help=f"soft prompt length ({d.num_virtual_tokens})",
    )


def _add_training_options(run: argparse._ArgumentGroup, d: TrainSettings) -> None:
    run.add_argument("--epochs", type=int, default=d.epochs, help=f"at most this many epochs ({d.epochs})")
    run.add_argument("--lr", type=float, help="learning rate (LoRA 1e-3, IA3 1e-2, prompt tuning 3e-2)")
    run.add_argument(
        "--batch-size", type=int, default=d.batch_size, help=f"samples per step ({d.batch_size})"
    )
    run.add_argument(
        "--eval-fraction", type=float, default=d.eval_fraction, help=f"held-out share ({d.eval_fraction:g})"
    )
    run.add_argument(
        "--patience",
        type=int,
        default=d.patience,
        help=f"epochs without improvement before stopping ({d.patience})",
    )
    run.add_argument(
        "--seed", type=int, default=d.seed, help=f"fixes split, order and initial weights ({d.seed})"
    )
    run.add_argument("--max-length", type=int, help="longest sample in tokens (the model's context)")
    run.add_argument("--device", help="cpu, cuda or cuda:N (CUDA when present)")


def _add_package_options(pack: argparse._ArgumentGroup) -> None:
    pack.add_argument("--name", help="the expert's name")
    pack.add_argument("--version", help="a SemVer 2.0 version")
    pack.add_argument("--description", help="what the expert is good at")
    pack.add_argument("--key", type=Path, metavar="PRIVATE_KEY", help="signing.key from keygen")
    pack.add_argument("--package", type=Path, metavar="FILE.expert", help="the package to write")
    add_metadata_options(pack)
    pack.add_argument(
        "--examples",
        type=int,
        default=32,
        metavar="N",
        help="training prompts listed in the manifest (32, at most 50)",
    )


def _train(args: argparse.Namespace) -> int:
    from libs.experts.errors import ManifestError
    from libs.experts.signing import SigningError
    from libs.training.data import DataError, read_jsonl
    from libs.training.expert import PackError, train_expert
    from libs.training.run import PreparedRun
    from libs.training.trainer import SettingsError
    from tools.training.console import print_summary, progress_bar

    # Everything is checked before the model loads: settings, paths, package metadata, the data.
    packing = _check_options(args)
    try:
        settings = settings_from(args)
        package = _package_spec(args) if packing else None
        prepared = PreparedRun(args.base, read_jsonl(args.data), settings)
    except (SettingsError, DataError, ManifestError, SigningError) as exc:
        raise UsageError(str(exc)) from None

    try:
        summary = train_expert(prepared, args.out, package, progress_bar)
    except PackError as exc:
        raise UsageError(str(exc)) from None
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print_summary(summary)
    return 0


def _check_options(args: argparse.Namespace) -> bool:
    """The paths and the package options checked; whether a package is to be written."""
    from libs.training.run import MAX_EXAMPLES

    if not (args.base / "config.json").is_file():
        raise UsageError(f"--base: {args.base} is not a checkpoint directory (no config.json)")
    if args.out.exists() and not args.force:
        raise UsageError(f"--out: {args.out} already exists (--force replaces it)")
    packing = [o for o in _PACKAGE_OPTIONS if getattr(args, o) is not None]
    if (packing or args.package) and len(packing) < len(_PACKAGE_OPTIONS):
        missing = [f"--{o}" for o in _PACKAGE_OPTIONS if getattr(args, o) is None]
        given = ", ".join("--" + o for o in packing) or "--package"
        raise UsageError(f"{', '.join(missing)}: needed to write a package (with {given})")
    if not 0 <= args.examples <= MAX_EXAMPLES:
        raise UsageError(f"--examples: must be in [0, {MAX_EXAMPLES}]")
    return bool(packing)


def _package_spec(args: argparse.Namespace) -> PackageSpec:
    """The package to write: its path, signing key and checked metadata."""
    from libs.experts.package import PACKAGE_SUFFIX
    from libs.experts.packing import check_metadata
    from libs.experts.signing import load_private_key
    from libs.training.expert import PackageSpec

    package_path = args.package or args.out.parent / f"{args.name}-{args.version}{PACKAGE_SUFFIX}"
    if package_path.suffix != PACKAGE_SUFFIX:
        raise UsageError(f"--package: {package_path} does not end with {PACKAGE_SUFFIX}")
    if package_path.exists() and not args.force:
        raise UsageError(f"--package: {package_path} already exists (--force replaces it)")
    key = load_private_key(args.key)
    metadata = metadata_from(args)
    check_metadata(metadata, args.base)
    return PackageSpec(metadata, key, package_path, args.examples)


def settings_from(args: argparse.Namespace):
    """The `TrainSettings` the options give (raises SettingsError naming the option)."""
    from libs.training.trainer import TrainSettings

    return TrainSettings(
        adapter_type=args.type,
        rank=args.rank,
        alpha=args.alpha,
        dropout=args.dropout,
        target_modules=_modules(args.target_modules),
        feedforward_modules=_modules(args.feedforward_modules),
        num_virtual_tokens=args.virtual_tokens,
        epochs=args.epochs,
        learning_rate=args.lr,
        batch_size=args.batch_size,
        eval_fraction=args.eval_fraction,
        patience=args.patience,
        seed=args.seed,
        max_length=args.max_length,
        device=args.device,
    )


def _modules(value: str | None) -> tuple[str, ...] | None:
    return None if value is None else split_list(value)
