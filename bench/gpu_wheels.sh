#!/bin/sh
# The wheels bench/gpu.py needs that the GPU machines' image lacks (Python 3.12, x86-64), into .whl/
# (git-ignored through .git/info/exclude). The device call carries .whl and installs them first:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && PYTHONPATH=/tmp/site:. python3 bench/gpu.py
set -eu
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
version() { .venv/bin/python -c "import importlib.metadata as m; print(m.version('$1'))"; }
platforms=""
for n in 17 24 27 28 31 34 35; do platforms="$platforms --platform manylinux_2_${n}_x86_64"; done
for package in llguidance cryptography cffi pycparser; do
    # shellcheck disable=SC2086
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        $platforms --platform manylinux2014_x86_64 -d .whl "$package==$(version "$package")"
done
ls -la .whl
