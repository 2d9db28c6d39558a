"""Checks of the code's shape that `make lint` runs beside ruff: the import-linter contract types the
project adds (pyproject.toml, [tool.importlinter])."""
