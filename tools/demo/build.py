"""`make experts`: train the demo set as `expertctl expert train` trains (the same trainer and packing,
called directly), sign it with a local demo key, and install it into a running stack as `expertctl
expert install` does (`tools.install`).

Everything lands under `data/demo-experts/` (one folder per expert: its `train.jsonl`, the PEFT
adapter, the package and a stamp of what made it). An expert whose stamp matches its recipe, data and
base model is not trained again, so a second run takes seconds. The demo key (`data/keys/demo/`) is
made on first use and its public half copied into the trusted keys, so the stack accepts the set.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

from tools.demo.catalog import RECIPES, VERSION, Recipe

ROOT = Path("data/demo-experts")
DEMO_KEYS = Path("data/keys/demo")
TRUSTED = Path("data/keys/trusted")
AUTHOR = "expert-system demo set"
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
    from tools.local_keys import local_publisher_key

    return local_publisher_key(keys, trusted)


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
        _train(recipe, data, base, key, folder / "adapter", package)
        (folder / _STAMP).write_text(json.dumps(stamp, indent=2))
        seconds = time.perf_counter() - started
        log(f"{recipe.name}: trained in {seconds:.0f} s")
        built.append(Built(recipe.name, package, seconds))
    return built


def _train(recipe: Recipe, data: Path, base: Path, key: Path, out: Path, package: Path) -> None:
    """Train and pack one expert as `expertctl expert train DATA --force` with the recipe's flags and
    metadata does: the same checks before the model loads, the same training and packing after."""
    from libs.experts.errors import ManifestError
    from libs.experts.packing import ExpertMetadata, check_metadata
    from libs.experts.signing import SigningError, load_private_key
    from libs.training.data import DataError, read_jsonl
    from libs.training.expert import PackageSpec, PackError, train_expert
    from libs.training.run import PreparedRun
    from libs.training.trainer import SettingsError
    from tools.training.console import print_summary, progress_bar

    metadata = ExpertMetadata(
        name=recipe.name,
        version=VERSION,
        description=recipe.skill.description,
        keywords=tuple(recipe.skill.keywords),
        incompatible_with=recipe.incompatible_with,
        author=AUTHOR,
    )
    try:
        settings = recipe.settings()
        spec = PackageSpec(metadata, load_private_key(key), package)
        check_metadata(metadata, base)
        prepared = PreparedRun(base, read_jsonl(data), settings)
        print_summary(train_expert(prepared, out, spec, progress_bar))
    except (SettingsError, DataError, ManifestError, SigningError, PackError, OSError) as exc:
        raise BuildError(f"{recipe.name}: training failed: {exc}") from None


def install(packages: list[Path], base: Path, router: str | None = None) -> None:
    """Install each package into the store and the router of a running stack, as `expertctl expert
    install PACKAGE --model BASE` does: the same store, trusted keys, router and credentials unless
    `router` names another router."""
    import grpc

    from expert_system.errors import error_from_call
    from libs.experts.errors import ManifestError, PackageError
    from libs.experts.manifest import BaseModelIdentity
    from libs.experts.signing import Keyring, SigningError
    from libs.experts.store import ExpertStore, StoreError
    from libs.gen.expert.v1 import router_pb2_grpc
    from tools.credentials import env_credentials, internal_channel
    from tools.install import (
        DEFAULT_ROUTER,
        DEFAULT_STORE,
        DEFAULT_TRUSTED,
        ROUTER_ENV,
        STORE_ENV,
        TRUSTED_ENV,
        installed_line,
        register,
        setting,
    )

    store = ExpertStore(setting(None, STORE_ENV, DEFAULT_STORE))
    trusted = Path(setting(None, TRUSTED_ENV, DEFAULT_TRUSTED))
    target = setting(router, ROUTER_ENV, DEFAULT_ROUTER)
    try:
        keyring = Keyring.from_dir(trusted)
        base_model = BaseModelIdentity.from_dir(base)
        # The router's port: mutual TLS with EXPERT_TLS_* when set (a ConfigError is a ValueError).
        channel = internal_channel(target)
    except (OSError, SigningError, ValueError, ManifestError) as exc:
        raise BuildError(f"cannot install the demo set: {exc}") from None
    with channel:
        router_stub = router_pb2_grpc.RouterServiceStub(channel)
        for package in packages:
            try:
                entry, created = store.install(package, keyring, base_model)
                register(router_stub, entry, env_credentials())
            except (PackageError, ManifestError, StoreError, OSError) as exc:
                raise BuildError(f"installing {package.name} failed: {exc}") from None
            except grpc.RpcError as exc:
                raise BuildError(
                    f"installing {package.name} failed: the router at {target} did not register it "
                    f"({error_from_call(exc)}); is the stack running (`make run`)?"
                ) from None
            print(installed_line(entry, created))


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
