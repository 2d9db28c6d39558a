"""`python -m libs.engine.kernels build`: compile the C++ kernels ahead of first use."""

import sys
import time

from libs.engine.kernels.build import build_dir, load, load_error


def main(argv: list[str]) -> int:
    if argv[1:] != ["build"]:
        print("usage: python -m libs.engine.kernels build", file=sys.stderr)
        return 2
    started = time.monotonic()
    if not load(verbose=False):
        print(f"kernels: build failed: {load_error()}", file=sys.stderr)
        return 1
    print(f"kernels: ready in {build_dir()} ({time.monotonic() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
