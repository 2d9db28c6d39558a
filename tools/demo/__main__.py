"""`python -m tools.demo [--no-install] [--with-draft] [--base DIR] [--router HOST:PORT]`:
build the demo expert set (cached) and install it into the running stack (`make experts`).

The deliberately bad `json-extract-draft` is built too but installed only with `--with-draft`: the
router prefers it until feedback teaches otherwise, which needs requests that carry a JSON schema."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from libs.engine.config import DEFAULT_MODEL
from tools.demo.build import BuildError, build, install
from tools.demo.catalog import DRAFT

DEFAULT_MODEL_DIR = Path(DEFAULT_MODEL)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.demo", description=__doc__)
    parser.add_argument("--base", type=Path, default=DEFAULT_MODEL_DIR, help="the base model")
    parser.add_argument("--router", help="the router to register with (default: expertctl's)")
    parser.add_argument("--no-install", action="store_true", help="build only")
    parser.add_argument("--with-draft", action="store_true", help="also install the mislabelled draft")
    args = parser.parse_args(argv)
    if not (args.base / "config.json").is_file():
        print(f"demo: {args.base} is not a checkpoint (make model makes the default one)", file=sys.stderr)
        return 2
    started = time.perf_counter()
    try:
        built = build(args.base)
        trained = sum(b.seconds for b in built)
        elapsed = time.perf_counter() - started
        print(f"demo set: {len(built)} experts, {trained / 60:.1f} min of training, {elapsed:.0f} s in all")
        if not args.no_install:
            chosen = [b for b in built if args.with_draft or b.name != DRAFT]
            install([b.package for b in chosen], args.base, args.router)
            print("installed: `expertctl expert list` shows them, `expertctl infer --trace` a choice")
    except BuildError as exc:
        print(f"demo: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
