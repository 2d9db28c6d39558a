"""`make experts`: train the demo set with `expertctl expert train`, sign it with a local demo key,
and install it into a running stack.

Everything lands under `data/demo-experts/` (one folder per expert: its `train.jsonl`, the PEFT
adapter, the package and a stamp of what made it). An expert whose stamp matches its recipe, data and
base model is not trained again, so a second run takes seconds. The demo key (`data/keys/demo/`) is
made on first use and its public half copied into the trusted keys, so the stack accepts the set.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from libs.expertctl.main import main as expertctl
from libs.experts.demo.catalog import RECIPES, VERSION, Recipe

ROOT = Path("data/demo-experts")
DEMO_KEYS = Path("data/keys/demo")
TRUSTED = Path("data/keys/trusted")
_STAMP = "stamp.json"


class BuildError(RuntimeError):
    """A step of the build failed; the message says which."""


@dataclass(frozen=True)
class Built:
    name: str
    package: Path
    seconds: float  # 0 when the cached package was kept


def package_path(recipe: Recipe, root: Path = ROOT) -> Path:
    return root / recipe.name / f"{recipe.name}-{VERSION}.expert"


def demo_key(keys: Path = DEMO_KEYS, trusted: Path = TRUSTED) -> Path:
    """The demo signing key, made on first use; its public key is put among the trusted keys."""
    from libs.experts.signing import generate_keypair, key_id, load_public_key

    if not (keys / "signing.key").is_file():
        generate_keypair(keys)
    public = keys / "signing.pub"
    trusted.mkdir(parents=True, exist_ok=True)
    target = trusted / f"{key_id(load_public_key(public))}.pub"
    if not target.exists():
        shutil.copy(public, target)
    return keys / "signing.key"


def build(
    base: Path, root: Path = ROOT, key: Path | None = None, log=print, recipes: tuple[Recipe, ...] = RECIPES
) -> list[Built]:
    """Train (or keep) every demo expert; their packages, in catalog order."""
    key = key or demo_key()
    built = []
    for recipe in recipes:
        folder = root / recipe.name
        folder.mkdir(parents=True, exist_ok=True)
        data = folder / "train.jsonl"
        train, _ = recipe.splits()
        data.write_text("".join(json.dumps(e.to_json(), ensure_ascii=False) + "\n" for e in train))
        stamp = _stamp(recipe, data, base, key)
        package = package_path(recipe, root)
        if package.is_file() and _read_stamp(folder) == stamp:
            log(f"{recipe.name}: up to date ({package})")
            built.append(Built(recipe.name, package, 0.0))
            continue
        log(f"{recipe.name}: training {recipe.skill.adapter} on {len(train)} samples ({recipe.skill.metric})")
        started = time.perf_counter()
        code = expertctl(
            ["expert", "train", str(data), "--base", str(base), "--out", str(folder / "adapter"), "--force",
             *recipe.train_flags(), "--name", recipe.name, "--version", VERSION,
             "--description", recipe.skill.description, "--keywords", ",".join(recipe.skill.keywords),
             "--incompatible-with", ",".join(recipe.incompatible_with), "--author", "expert-system demo set",
             "--key", str(key), "--package", str(package)]
        )  # fmt: skip
        if code != 0:
            raise BuildError(f"{recipe.name}: expertctl expert train failed (status {code})")
        (folder / _STAMP).write_text(json.dumps(stamp, indent=2))
        seconds = time.perf_counter() - started
        log(f"{recipe.name}: trained in {seconds:.0f} s")
        built.append(Built(recipe.name, package, seconds))
    return built


def install(packages: list[Path], base: Path, router: str | None = None) -> None:
    """`expertctl expert install` for each package (into the store and the router of a running stack)."""
    for package in packages:
        args = ["expert", "install", str(package), "--model", str(base)]
        if router:
            args += ["--router", router]
        code = expertctl(args)
        if code != 0:
            raise BuildError(
                f"installing {package.name} failed (status {code}); is the stack running (`make run`)?"
            )


def _stamp(recipe: Recipe, data: Path, base: Path, key: Path) -> dict:
    """What an expert's package depends on: the recipe, the data, the base model, the signing key."""
    from libs.experts.manifest import BaseModelIdentity
    from libs.experts.signing import key_id, load_private_key

    return {
        "recipe": [
            *recipe.train_flags(),
            recipe.skill.description,
            *recipe.skill.keywords,
            *recipe.incompatible_with,
        ],
        "data_sha256": hashlib.sha256(data.read_bytes()).hexdigest(),
        "base_model": BaseModelIdentity.from_dir(base).config_hash,
        "key_id": key_id(load_private_key(key).public_key()),
    }


def _read_stamp(folder: Path) -> dict | None:
    try:
        return json.loads((folder / _STAMP).read_text())
    except (OSError, ValueError):
        return None
