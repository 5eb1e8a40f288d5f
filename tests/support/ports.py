"""Loopback ports for the tests' and benches' servers, and a URL where nothing listens."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager


def free_port() -> int:
    """A port the kernel just handed out and took back, for a child process that accepts only a
    port number (`serve --port`, the router, `sim-worker`). Another process may take it before the
    child binds it: in-process servers bind port 0 themselves instead (sockets.listen, serve_in_thread)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def refused_url() -> Iterator[str]:
    """An http URL on a port held by a bound socket that never listens: every connection is refused
    for as long as the block runs, and no other process can start listening there meanwhile."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
