"""What people run, not what services import: the command line (`expertctl`), the local launcher and
its supervisor (`stack`, `supervisor`), expert training and the demo expert set. Imports go one way,
tools -> services -> libs; `make lint` (import-linter, pyproject.toml) checks it."""
