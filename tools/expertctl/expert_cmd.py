"""`expertctl expert` (or `experts`: one command under both names, so neither is a typo): signing
keys, signed `.expert` packages built from PEFT adapters, and the experts installed.

`keygen` makes an ed25519 key pair, `pack` turns a PEFT adapter directory into a signed package,
`verify` checks a package against a directory of trusted public keys (and optionally a base
model), `inspect` shows what a package holds and how much memory its weights take, `train`
trains one; `install`, `list`, `show` and `remove` are the experts installed in the store and
registered with the router.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from libs.experts.errors import ManifestError, PackageError
from tools.expertctl import registry_cmd, train_cmd
from tools.expertctl.errors import UsageError
from tools.expertctl.metadata_options import add_metadata_options, metadata_from
from tools.expertctl.model_cmd import DEFAULT_MODEL_DIR

if TYPE_CHECKING:
    from libs.experts.manifest import Manifest
    from libs.experts.package import PackageInfo

DTYPES = ("float32", "bfloat16", "float16")
_TENSORS_SHOWN = 6


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `expert keygen|pack|verify|install|inspect|train|list|show|remove` to the `expertctl`
    parser, also named `experts`."""
    parser = subparsers.add_parser(
        "expert",
        aliases=["experts"],
        help="build, verify, inspect, install and list experts",
        description=__doc__,
    )
    actions = parser.add_subparsers(dest="expert_action", required=True, metavar="ACTION")

    keygen = actions.add_parser("keygen", help="create an ed25519 signing key pair")
    keygen.add_argument(
        "--out", metavar="DIR", type=Path, required=True, help="where to write signing.key/.pub"
    )
    keygen.set_defaults(handler=_keygen)

    pack = actions.add_parser("pack", help="pack a PEFT adapter directory into a signed .expert file")
    pack.add_argument("peft_dir", metavar="PEFT_DIR", type=Path, help="a directory saved by peft")
    pack.add_argument("--name", required=True, help="the expert's name ([a-z0-9][a-z0-9-]{1,63})")
    pack.add_argument("--version", required=True, help="a SemVer 2.0 version, e.g. 1.0.0")
    pack.add_argument("--description", required=True, help="what the expert is good at")
    add_metadata_options(pack)
    pack.add_argument(
        "--examples",
        type=Path,
        metavar="FILE",
        help="example prompts: one per line, or a JSON list of strings",
    )
    pack.add_argument(
        "--base-model",
        type=Path,
        metavar="DIR",
        help="the checkpoint the adapter fits (default: the adapter's base_model_name_or_path if it is a "
        f"local checkpoint, else {DEFAULT_MODEL_DIR})",
    )
    pack.add_argument(
        "--key", type=Path, required=True, metavar="PRIVATE_KEY", help="signing.key from keygen"
    )
    pack.add_argument("--out", type=Path, required=True, metavar="FILE.expert", help="the package to write")
    pack.add_argument("--force", action="store_true", help="replace FILE.expert if it exists")
    pack.set_defaults(handler=_pack)

    verify = actions.add_parser("verify", help="verify a package's signature, checksums and contents")
    verify.add_argument("file", metavar="FILE", type=Path, help="the .expert file")
    verify.add_argument(
        "--trusted", type=Path, required=True, metavar="DIR", help="directory of trusted *.pub keys"
    )
    verify.add_argument(
        "--base-model", type=Path, metavar="DIR", help="also check that it fits this checkpoint"
    )
    verify.set_defaults(handler=_verify)

    registry_cmd.add_install(actions)
    registry_cmd.add_registry_actions(actions)
    train_cmd.add_train(actions)

    inspect = actions.add_parser("inspect", help="show a package's manifest, files, tensors and memory")
    inspect.add_argument("file", metavar="FILE", type=Path, help="the .expert file")
    inspect.add_argument("--dtype", choices=DTYPES, default="float32", help="dtype for the memory estimate")
    inspect.add_argument("--json", action="store_true", help="print the report as JSON")
    inspect.set_defaults(handler=_inspect)


def _keygen(args: argparse.Namespace) -> int:
    # Imported in the handlers so that other commands do not load `cryptography`.
    from libs.experts.signing import SigningError, generate_keypair, key_id, load_public_key

    try:
        private_path, public_path = generate_keypair(args.out)
    except SigningError as exc:
        raise UsageError(str(exc)) from None
    kid = key_id(load_public_key(public_path))
    print(f"key id:      {kid}")
    print(f"private key: {private_path} (keep it secret; `expertctl expert pack --key` signs with it)")
    print(f"public key:  {public_path}")
    print(
        f"servers trust this key once {public_path.name} is in their trusted keys directory "
        f"(name it {kid}.pub there, so keys from several publishers do not collide)"
    )
    return 0


def _pack(args: argparse.Namespace) -> int:
    from libs.experts.package import PACKAGE_SUFFIX, write_package
    from libs.experts.packing import pack_adapter
    from libs.experts.peft_adapter import read_peft_adapter
    from libs.experts.signing import SigningError, load_private_key

    if args.out.suffix != PACKAGE_SUFFIX:
        raise UsageError(f"--out: {args.out} does not end with {PACKAGE_SUFFIX}")
    if args.out.exists() and not args.force:
        raise UsageError(f"--out: {args.out} already exists (--force replaces it)")
    try:
        recorded = read_peft_adapter(args.peft_dir).config.get("base_model_name_or_path")
        base_dir = _base_model_dir(args.base_model, recorded)
        metadata = metadata_from(args, _read_examples(args.examples) if args.examples else ())
        data, package = pack_adapter(args.peft_dir, base_dir, metadata, load_private_key(args.key))
    except (PackageError, ManifestError, SigningError) as exc:
        raise UsageError(str(exc)) from None
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_package(args.out, data)
    print_packed(args.out, package, base_dir)
    return 0


def print_packed(path: Path, package, base_dir: Path) -> None:
    """What `pack` (and `train --package`) report of the package written."""
    manifest = package.manifest
    print(f"wrote {path}")
    print(f"  expert:       {manifest.name} {manifest.version} ({_adapter_summary(manifest)})")
    print(f"  base model:   {base_dir} ({manifest.base_model.architecture})")
    print(f"  size:         {_size(package.size)}")
    print(f"  content hash: {package.content_hash}")
    print(f"  signed by:    key {package.key_id}")


def _verify(args: argparse.Namespace) -> int:
    from libs.experts.manifest import BaseModelIdentity
    from libs.experts.package import read_package
    from libs.experts.signing import Keyring, SigningError

    try:
        keyring = Keyring.from_dir(args.trusted)
    except SigningError as exc:
        return _fail(f"--trusted: {exc}")
    try:
        package = read_package(args.file, keyring)
    except PackageError as exc:
        return _fail(_about(args.file, exc))
    fits = ""
    if args.base_model is not None:
        try:
            model = BaseModelIdentity.from_dir(args.base_model)
        except ManifestError as exc:
            return _fail(f"--base-model: {exc}")
        problem = package.manifest.base_model.mismatch(model)
        if problem is not None:
            return _fail(f"{args.file}: does not fit the base model {args.base_model}: {problem}")
        fits = f", fits {args.base_model}"
    m = package.manifest
    print(
        f"{args.file}: OK: {m.name} {m.version} ({m.adapter_type}), signed by trusted key {package.key_id}, "
        f"content hash {package.content_hash[:16]}, {_size(package.size)}{fits}"
    )
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from libs.experts.package import inspect_package

    try:
        info = inspect_package(args.file, dtype=args.dtype)
    except PackageError as exc:
        return _fail(_about(args.file, exc))
    if args.json:
        print(json.dumps(info.to_dict(), indent=2, ensure_ascii=False))
        return 0
    for label, text in _report_rows(info):
        print(f"{label:<13}{text}")
    return 0


def _report_rows(info: PackageInfo) -> list[tuple[str, str]]:
    m, base = info.manifest, info.manifest.base_model
    key = info.key_id or "(unreadable signature.json)"
    rows = [
        ("expert", f"{m.name} {m.version} ({_adapter_summary(m)})"),
        ("description", m.description),
        ("author", m.author or "-"),
        (
            "base model",
            f"{base.architecture}, hidden {base.hidden_size}, {base.num_layers} layers, "
            f"vocab {base.vocab_size}, config hash {base.config_hash[:16]}",
        ),
        ("priority", str(m.priority)),
        ("capabilities", _list(m.capabilities)),
        ("keywords", _list(m.keywords)),
        ("task types", _list(m.task_types)),
        ("examples", str(len(m.examples))),
        ("incompatible", _list(m.incompatible_with)),
        ("package", f"{_size(info.size)}, content hash {info.content_hash}"),
        ("signature", f"key {key} (as claimed; `expertctl expert verify` checks it)"),
        ("checksums", "ok" if info.checksums_ok else "FAILED: " + "; ".join(info.checksum_problems)),
    ]
    for i, f in enumerate(info.files):
        status = {True: "ok", False: "MISMATCH", None: ""}[f.checksum_ok]
        rows.append(("files" if i == 0 else "", f"{f.name:<28} {f.size:>12,} B  {status}".rstrip()))
    dtypes = ", ".join(sorted({t.dtype for t in info.tensors}))
    rows.append(
        ("tensors", f"{len(info.tensors)} tensors, {info.num_parameters:,} parameters, stored as {dtypes}")
    )
    rows += [("", f"{t.name} {list(t.shape)} {t.dtype}") for t in info.tensors[:_TENSORS_SHOWN]]
    if len(info.tensors) > _TENSORS_SHOWN:
        rows.append(("", f"… {len(info.tensors) - _TENSORS_SHOWN} more (--json lists them all)"))
    rows.append(("vram", f"{info.vram_mb:.3f} MiB as {info.dtype}"))
    return rows


def _base_model_dir(given: Path | None, recorded: object) -> Path:
    if given is not None:
        if not (given / "config.json").is_file():
            raise UsageError(f"--base-model: {given} is not a checkpoint directory (no config.json)")
        return given
    if isinstance(recorded, str) and recorded and (Path(recorded) / "config.json").is_file():
        return Path(recorded)
    if (DEFAULT_MODEL_DIR / "config.json").is_file():
        return DEFAULT_MODEL_DIR
    raise UsageError(
        f"--base-model: the adapter's base model {recorded!r} is not a local checkpoint and the default "
        f"{DEFAULT_MODEL_DIR} is missing (`make model` makes it); pass --base-model DIR"
    )


def _read_examples(path: Path) -> tuple[str, ...]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--examples: cannot read {path} ({exc})") from None
    if text.lstrip().startswith("["):
        try:
            examples = json.loads(text)
        except ValueError as exc:
            raise UsageError(f"--examples: {path} starts with '[' but is not a JSON list ({exc})") from None
        if not isinstance(examples, list) or not all(isinstance(e, str) for e in examples):
            raise UsageError(f"--examples: {path} must be a JSON list of strings")
        return tuple(examples)
    return tuple(line.strip() for line in text.splitlines() if line.strip())


def _adapter_summary(m: Manifest) -> str:
    if m.adapter_type == "lora":
        rslora = ", rsLoRA" if m.use_rslora else ""
        return f"lora, rank {m.rank}, alpha {m.alpha:g}{rslora}, targets {', '.join(m.target_modules)}"
    if m.adapter_type == "ia3":
        return f"ia3, targets {', '.join(m.target_modules)}, feed-forward {_list(m.feedforward_modules)}"
    return f"soft_prompt, {m.num_virtual_tokens} virtual tokens"


def _list(values: tuple[str, ...]) -> str:
    return ", ".join(values) if values else "-"


def _size(n_bytes: int) -> str:
    return (
        f"{n_bytes / 2**10:.1f} KiB ({n_bytes:,} bytes)" if n_bytes < 2**20 else f"{n_bytes / 2**20:.1f} MiB"
    )


def _about(path: Path, exc: Exception) -> str:
    # Errors about the package's content do not know its path; errors about the file itself do.
    message = str(exc)
    return message if message.startswith(f"{path}: ") else f"{path}: {message}"


def _fail(message: str) -> int:
    # A refusal, not a usage error: `main` would exit 2 for a UsageError, and verify/inspect exit 1.
    print(f"expertctl: error: {message}", file=sys.stderr)
    return 1
