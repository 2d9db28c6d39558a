"""Free TCP ports for servers started by tests."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on localhost that nothing listens on right now (the OS picks it; a race with
    another process taking it before the caller binds is possible but rare)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
