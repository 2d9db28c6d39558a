"""Errors that `expertctl` commands raise for `main` to report."""


class UsageError(Exception):
    """A problem with what the user asked for: `main` prints it and exits with status 2."""
