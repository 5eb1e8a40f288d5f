"""The listening socket of `serve --workers` and of apps served in a running loop."""

from __future__ import annotations

import socket

LISTEN_BACKLOG = 2048  # uvicorn's default


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket whose connections send at once (TCP_NODELAY, inherited by accepted
    sockets on Linux). asyncio's own loop sets it only on sockets created with IPPROTO_TCP, which
    a passed-in socket's connections are not: without it, every response's body waits behind its
    headers for the client's delayed ACK, 40 ms a request."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=LISTEN_BACKLOG)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def own_url(sock: socket.socket) -> str:
    """The base URL this host's processes reach a listening socket at (loopback for a wildcard)."""
    host, port = sock.getsockname()[:2]
    if sock.family == socket.AF_INET6:
        return f"http://[{'::1' if host == '::' else host}]:{port}"
    return f"http://{'127.0.0.1' if host == '0.0.0.0' else host}:{port}"
