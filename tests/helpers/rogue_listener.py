"""A rogue local process: TCP listeners on the IPv6 loopback at the ports a stack's services use on
127.0.0.1, recording every connection they accept (what a client that dialled `localhost` and got
::1 would have handed them)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterable


def ipv6_loopback_available() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as sock:
            sock.bind(("::1", 0))
        return True
    except OSError:
        return False


class RogueListeners:
    """Listens on [::1]:port for each of `ports` until closed; `received` maps each port to the
    bytes every accepted connection sent (one entry per connection)."""

    def __init__(self, ports: Iterable[int]) -> None:
        self.received: dict[int, list[bytes]] = {}
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        for port in ports:
            sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
            # Only ::1: 127.0.0.1 stays free for the real service.
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(("::1", port))
            sock.listen(64)
            self._sockets.append(sock)
            self.received[port] = []
            threading.Thread(target=self._accept, args=(sock, port), daemon=True).start()

    def _accept(self, sock: socket.socket, port: int) -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._read, args=(conn, port), daemon=True).start()

    def _read(self, conn: socket.socket, port: int) -> None:
        with self._lock:
            index = len(self.received[port])
            self.received[port].append(b"")
        conn.settimeout(30)
        with conn:
            while True:
                try:
                    data = conn.recv(65536)
                except OSError:
                    return
                if not data:
                    return
                with self._lock:
                    self.received[port][index] += data

    def connections(self) -> dict[int, int]:
        """The number of connections accepted on each port that got any."""
        with self._lock:
            return {port: len(seen) for port, seen in self.received.items() if seen}

    def close(self) -> None:
        for sock in self._sockets:
            sock.close()
