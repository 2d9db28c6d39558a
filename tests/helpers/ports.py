"""Free TCP ports for servers started by tests: tools.stack's, which avoids the ephemeral range
that clients' outgoing connections take their ports from."""

from tools.stack import free_port

__all__ = ["free_port"]
