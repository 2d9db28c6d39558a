"""Errors raised while reading a checkpoint."""


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be served: the message names the file, field or tensor."""
