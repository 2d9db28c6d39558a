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
import sys
from pathlib import Path

from libs.expertctl.errors import UsageError
from libs.expertctl.model_cmd import DEFAULT_MODEL_DIR

_PACKAGE_OPTIONS = ("name", "version", "description", "key")


def add_train(actions: argparse._SubParsersAction) -> None:
    """`expert train` (added to the `expert` command's actions)."""
    from libs.expertctl.expert_cmd import add_metadata_options  # expert_cmd registers this module
    from libs.experts.training.trainer import ADAPTER_TYPES, TrainSettings

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
    shape = train.add_argument_group("adapter")
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
    run = train.add_argument_group("training")
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
    pack = train.add_argument_group("package (all of --name, --version, --description and --key)")
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
    train.set_defaults(handler=_train)


def _train(args: argparse.Namespace) -> int:
    from libs.expertctl.expert_cmd import metadata_from
    from libs.experts.errors import ManifestError, PackageError
    from libs.experts.package import PACKAGE_SUFFIX, write_package
    from libs.experts.packing import check_metadata, pack_adapter
    from libs.experts.signing import SigningError, load_private_key
    from libs.experts.training.data import DataError, read_jsonl
    from libs.experts.training.run import MAX_EXAMPLES, PreparedRun
    from libs.experts.training.trainer import SettingsError, TrainSettings

    # Everything is checked before the model loads: settings, paths, package metadata, the data.
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
    try:
        settings = TrainSettings(
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
        metadata = key = package_path = None
        if packing:
            package_path = args.package or args.out.parent / f"{args.name}-{args.version}{PACKAGE_SUFFIX}"
            if package_path.suffix != PACKAGE_SUFFIX:
                raise UsageError(f"--package: {package_path} does not end with {PACKAGE_SUFFIX}")
            if package_path.exists() and not args.force:
                raise UsageError(f"--package: {package_path} already exists (--force replaces it)")
            key = load_private_key(args.key)
            metadata = metadata_from(args)
            check_metadata(metadata, args.base)
        prepared = PreparedRun(args.base, read_jsonl(args.data), settings)
    except (SettingsError, DataError, ManifestError, SigningError) as exc:
        raise UsageError(str(exc)) from None

    report = prepared.train(args.out, _progress_bar)  # replaces --out only once training finished
    summary = {"adapter": report.to_dict()}
    if metadata is not None:
        metadata = metadata.with_examples(prepared.example_prompts(args.examples))
        try:
            data, package = pack_adapter(args.out, args.base, metadata, key)
        except (PackageError, ManifestError) as exc:
            raise UsageError(f"the adapter was written to {args.out} but cannot be packed: {exc}") from None
        package_path.parent.mkdir(parents=True, exist_ok=True)
        write_package(package_path, data)
        summary["package"] = {
            "path": str(package_path),
            "name": package.manifest.name,
            "version": package.manifest.version,
            "content_hash": package.content_hash,
            "size": package.size,
            "examples": len(package.manifest.examples),
        }
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        _print_summary(summary)
    return 0


def _print_summary(summary: dict) -> None:
    a = summary["adapter"]
    print(
        f"wrote {a['adapter_dir']} ({a['adapter_type']}, {a['trainable_parameters']:,} trainable parameters)"
    )
    print(f"  samples:  {a['train_samples']} train, {a['eval_samples']} held out; device {a['device']}")
    for e in a["epochs"]:
        held_out = f"{e['eval_loss']:.4f}" if e["eval_loss"] is not None else "-"
        best = "  (best)" if e["epoch"] == a["best_epoch"] else ""
        losses = f"train loss {e['train_loss']:.4f}, eval loss {held_out}"
        print(f"  epoch {e['epoch']}:  {losses}, {e['seconds']:.0f} s{best}")
    stopped = ", stopped early" if a["stopped_early"] else ""
    print(f"  speed:    {a['tokens_per_second']:.0f} tokens/s, {a['seconds']:.0f} s in all{stopped}")
    if "package" in summary:
        p = summary["package"]
        print(f"wrote {p['path']}")
        print(f"  expert:       {p['name']} {p['version']} ({p['examples']} example prompts)")
        print(f"  content hash: {p['content_hash']}")


def _progress_bar(epoch: int, epochs: int):
    """A tqdm bar per epoch on stderr, with the running loss and tokens per second."""
    from tqdm import tqdm

    bar = None

    def update(step: int, steps: int, loss: float, tokens_per_second: float) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(total=steps, desc=f"epoch {epoch}/{epochs}", unit="step", file=sys.stderr, leave=True)
        bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_second:.0f}", refresh=False)
        bar.update(1)
        if step == steps:
            bar.close()

    return update


def _modules(value: str | None) -> tuple[str, ...] | None:
    from libs.expertctl.expert_cmd import split_list

    return None if value is None else split_list(value)
