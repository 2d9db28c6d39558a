#!/bin/sh
# The wheels bench/gpu.py needs that the GPU machines' image lacks (Python 3.12, x86-64), into .whl/
# (git-ignored through info/exclude, so the device call must name it in `carry`). llguidance and
# cryptography are imported when libs.engine is (grammar.py; the expert packages' signatures):
# without them every section that starts our engine fails, while the script itself still runs.
# The device command (docs/engine.md#measuring-it-benchgpupy) installs whichever of them are there.
# PY: the interpreter whose installed versions are fetched (.venv/bin/python; in a worktree, the
# main checkout's, e.g. PY=../main/.venv/bin/python).
set -eu
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
platforms=""
for n in 17 24 27 28 31 34 35; do platforms="$platforms --platform manylinux_2_${n}_x86_64"; done
for package in llguidance cryptography cffi pycparser; do
    # shellcheck disable=SC2086
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        $platforms --platform manylinux2014_x86_64 -d .whl "$package==$(version "$package")"
done
ls -la .whl
