"""`expertctl expert install|list|show|remove` (`experts` is the same command): installed experts.

`install` verifies a package (signature against the trusted keys, the base model it must fit),
stores it in the expert store by content hash, and registers it with the router, which indexes it
for selection. Installing the same package again is harmless (it registers again); the same name
and version with other content is refused. `list`, `show` and `remove` read and change the router's
registry; `remove` also deletes the expert's packages from the store.
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Callable
from pathlib import Path

from tools.expertctl.credentials import add_api_key_argument, call_with_credentials
from tools.expertctl.errors import UsageError
from tools.expertctl.model_cmd import DEFAULT_MODEL_DIR
from tools.install import (
    DEFAULT_ROUTER,
    DEFAULT_STORE,
    DEFAULT_TRUSTED,
    ROUTER_ENV,
    STORE_ENV,
    TIMEOUT,
    TRUSTED_ENV,
    installed_line,
    setting,
)
from tools.install import register as register_expert


def add_install(actions: argparse._SubParsersAction) -> None:
    """`expert install` (added to the `expert` command's actions)."""
    install = actions.add_parser("install", help="verify a package, store it and register it with the router")
    install.add_argument("file", metavar="FILE", type=Path, help="the .expert file")
    _add_store_arguments(install)
    install.add_argument(
        "--trusted",
        type=Path,
        metavar="DIR",
        help=f"trusted *.pub keys (default ${TRUSTED_ENV}, else {DEFAULT_TRUSTED})",
    )
    install.add_argument(
        "--model",
        type=Path,
        metavar="DIR",
        help=f"the checkpoint the expert must fit (default $EXPERT_MODEL_PATH, else {DEFAULT_MODEL_DIR})",
    )
    _add_router_arguments(install)
    install.set_defaults(handler=_install)


def add_registry_actions(actions: argparse._SubParsersAction) -> None:
    """`expert list|show|remove` (added to the `expert` command's actions)."""
    listing = actions.add_parser("list", help="every registered expert")
    _add_router_arguments(listing)
    listing.set_defaults(handler=_list)
    show = actions.add_parser("show", help="one expert: its registration and the versions in the store")
    show.add_argument("name", metavar="NAME")
    _add_store_arguments(show)
    _add_router_arguments(show)
    show.set_defaults(handler=_show)
    remove = actions.add_parser("remove", help="unregister an expert and delete its packages from the store")
    remove.add_argument("name", metavar="NAME")
    _add_store_arguments(remove)
    _add_router_arguments(remove)
    remove.set_defaults(handler=_remove)


def _add_store_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--store",
        type=Path,
        metavar="DIR",
        help=f"the expert store (default ${STORE_ENV}, else {DEFAULT_STORE})",
    )


def _add_router_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--router", metavar="HOST:PORT", help=f"the router (default ${ROUTER_ENV}, else {DEFAULT_ROUTER})"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    add_api_key_argument(parser)  # the router's registry needs an admin key when auth is on


def _with_router(handler: Callable[[argparse.Namespace, object], int]) -> Callable[[argparse.Namespace], int]:
    """Open a channel to the router for the handler; its errors become one `expertctl: error:` line."""

    @functools.wraps(handler)
    def run(args: argparse.Namespace) -> int:
        from libs.gen.expert.v1 import router_pb2_grpc

        target = args.router = setting(args.router, ROUTER_ENV, DEFAULT_ROUTER)
        return call_with_credentials(
            args,
            target,
            router_pb2_grpc.RouterServiceStub,
            handler,
            refused="the router refused it",
            failed="the router",
            internal=True,  # mutual TLS with EXPERT_TLS_* when the stack has it
        )

    return run


@_with_router
def _install(args: argparse.Namespace, router) -> int:
    import grpc

    from expert_system.errors import InvalidRequest, error_from_call
    from libs.experts.errors import ManifestError, PackageError
    from libs.experts.manifest import BaseModelIdentity
    from libs.experts.signing import Keyring, SigningError
    from libs.experts.store import ExpertStore, StoreError

    store = ExpertStore(setting(args.store, STORE_ENV, DEFAULT_STORE))
    trusted = Path(setting(args.trusted, TRUSTED_ENV, DEFAULT_TRUSTED))
    model = Path(setting(args.model, "EXPERT_MODEL_PATH", DEFAULT_MODEL_DIR))
    if not args.file.is_file():
        raise UsageError(f"FILE: {args.file} is not a file")
    try:
        keyring = Keyring.from_dir(trusted)
    except (OSError, SigningError, ValueError) as exc:
        raise UsageError(f"--trusted: {trusted}: {exc}") from None
    try:
        base_model = BaseModelIdentity.from_dir(model)
    except ManifestError as exc:
        raise UsageError(f"--model: {exc}") from None
    try:
        entry, created = store.install(args.file, keyring, base_model)
    except (PackageError, ManifestError, StoreError, OSError) as exc:
        return _fail(f"{args.file}: {exc}")
    try:
        registered = register_expert(router, entry, args.metadata)
    except grpc.RpcError as exc:
        error = error_from_call(exc)
        if isinstance(error, InvalidRequest):
            raise UsageError(f"the router refused it: {error}") from None
        return _fail(
            f"{entry.name}@{entry.version} is in the store, but the router at {args.router} did not register "
            f"it ({error}); run the install again once the router answers"
        )
    if args.json:
        print(json.dumps({**_expert_dict(registered), "stored": created, "store": str(store.root)}, indent=2))
    else:
        print(installed_line(entry, created))
    return 0


@_with_router
def _list(args: argparse.Namespace, router) -> int:
    from libs.gen.expert.v1 import router_pb2

    experts = router.ListRegisteredExperts(
        router_pb2.ListRegisteredExpertsRequest(), timeout=TIMEOUT, metadata=args.metadata
    ).experts
    if args.json:
        print(json.dumps([_expert_dict(e) for e in experts], indent=2))
        return 0
    if not experts:
        print("no experts are registered")
        return 0
    print(f"{'name':<24}{'version':<12}{'type':<13}{'success':>8}{'uses':>7}  task types")
    for e in experts:
        tasks = ",".join(e.task_types) or "-"
        print(f"{e.name:<24}{e.version:<12}{e.adapter_type:<13}{e.success_rate:>8.3f}{e.uses:>7}  {tasks}")
    return 0


@_with_router
def _show(args: argparse.Namespace, router) -> int:
    from libs.experts.store import ExpertStore
    from libs.gen.expert.v1 import router_pb2

    expert = router.GetRegisteredExpert(
        router_pb2.GetRegisteredExpertRequest(name=args.name), timeout=TIMEOUT, metadata=args.metadata
    ).expert
    stored = [
        e.version for e in ExpertStore(setting(args.store, STORE_ENV, DEFAULT_STORE)).versions(args.name)
    ]
    if args.json:
        print(json.dumps({**_expert_dict(expert), "stored_versions": stored}, indent=2))
        return 0
    for key, value in _expert_dict(expert).items():
        print(f"{key:<18}{', '.join(value) if isinstance(value, list) else value}")
    print(f"{'stored_versions':<18}{', '.join(stored) or '-'}")
    return 0


@_with_router
def _remove(args: argparse.Namespace, router) -> int:
    from libs.experts.store import ExpertNotInstalledError, ExpertStore
    from libs.gen.expert.v1 import router_pb2

    router.UnregisterExpert(
        router_pb2.UnregisterExpertRequest(name=args.name), timeout=TIMEOUT, metadata=args.metadata
    )
    try:
        removed = ExpertStore(setting(args.store, STORE_ENV, DEFAULT_STORE)).remove(args.name)
    except ExpertNotInstalledError:
        removed = []
    versions = ", ".join(e.version for e in removed) or "none in this store"
    if args.json:
        print(json.dumps({"name": args.name, "removed_versions": [e.version for e in removed]}))
    else:
        print(f"{args.name} unregistered; packages deleted: {versions}")
    return 0


def _expert_dict(expert) -> dict:
    return {
        "name": expert.name,
        "version": expert.version,
        "adapter_type": expert.adapter_type,
        "description": expert.description,
        "keywords": list(expert.keywords),
        "task_types": list(expert.task_types),
        "capabilities": list(expert.capabilities),
        "incompatible_with": list(expert.incompatible_with),
        "priority": expert.priority,
        "content_hash": expert.content_hash,
        "weight_bytes": expert.weight_bytes,
        "success_rate": expert.success_rate,
        "uses": expert.uses,
    }


def _fail(message: str) -> int:
    import sys

    print(f"expertctl: error: {message}", file=sys.stderr)
    return 1
