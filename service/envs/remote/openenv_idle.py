"""OpenEnv server sessions kept open between episodes: an episode that ended between calls leaves
its WebSocket session to the server's next episode, which resets it (as OpenEnv's own clients run
episode after episode on one session). A new connection per episode (its handshake, the session
made and destroyed on the server, its tool list) was most of the service's CPU per env call,
profiled. Sessions kept stay within the server's cap (kept + in flight <= max_sessions_per_server)
and are ended after reuse_idle_seconds unused, or at shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from service.envs.remote.pool import Server, ServerPool


class IdleSessions:
    """The kept sessions of one env's servers (clients with an `open` property)."""

    def __init__(
        self, pool: ServerPool, idle_seconds: float, close: Callable[[Any], Awaitable[None]]
    ) -> None:
        self.pool = pool
        self.idle_seconds = idle_seconds
        self._close = close
        self._kept: dict[Server, deque[tuple[float, Any]]] = {server: deque() for server in pool.servers}
        self._sweeper: asyncio.Task[None] | None = None

    def keep(self, server: Server, client: Any) -> bool:
        """Keeps the session of an episode that is closing (whose slot is still held); False if it
        is not kept (reuse off, the connection gone, the server down or full), for the caller to
        end it."""
        kept = self._kept[server]
        if self.idle_seconds <= 0 or not client.open or server.down is not None:
            return False
        if len(kept) + server.sessions > server.cap:
            return False
        kept.append((time.monotonic(), client))
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever())
        return True

    def take(self, server: Server) -> Any:
        """The most recently kept session of `server` still within its idle time, or None. (Older
        ones are the sweeper's to end.)"""
        kept = self._kept[server]
        if kept and time.monotonic() - kept[-1][0] <= self.idle_seconds:
            return kept.pop()[1]
        return None

    def count(self) -> int:
        return sum(len(kept) for kept in self._kept.values())

    async def _end_expired(self) -> None:
        deadline = time.monotonic() - self.idle_seconds
        expired = []
        for kept in self._kept.values():
            while kept and kept[0][0] < deadline:
                expired.append(kept.popleft()[1])
        await asyncio.gather(*(self._close(client) for client in expired))

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.idle_seconds / 2)
            await self._end_expired()

    async def close(self) -> None:
        """Ends every kept session (shutdown)."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        clients = [client for kept in self._kept.values() for _, client in kept]
        for kept in self._kept.values():
            kept.clear()
        await asyncio.gather(*(self._close(client) for client in clients))
