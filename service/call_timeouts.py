"""CallTimeouts: the timeouts of many calls of one length, checked by one timer.

Hand-written on a measured hot path (every call to a remote env server, every engine call and env
call of a turn): asyncio.timeout, or a loop.call_later timer per call, costs about 4 us a call on
uvloop (its timer handle is a libuv timer made, started, stopped and closed per call), 5.6% of the
service's CPU per remote env call (perf, bench/remote_envs.py); a call here is one dict insert and
one pop (0.2 us). Calls of one length end in the order they started, so the dict's insertion order
is their deadlines' order, and the sweep reads only the expired ones from its front. A call's
deadline is noticed at most a twentieth of the length (and at most a second) late.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Hashable

logger = logging.getLogger(__name__)

SWEEPS_PER_LENGTH = 20  # the sweep's period, as a share of the length
MAX_SWEEP_SECONDS = 1.0


class CallTimeouts:
    """`add(key, expire)` as a call starts, `discard(key)` as it ends: `expire()` is called, on the
    event loop, once `seconds` have passed without the call ending. One key is one call at a time."""

    def __init__(self, seconds: float) -> None:
        if seconds <= 0:
            raise ValueError(f"a timeout must be > 0 s, not {seconds}")
        self.seconds = seconds
        self.period = min(seconds / SWEEPS_PER_LENGTH, MAX_SWEEP_SECONDS)
        self._calls: dict[Hashable, tuple[float, Callable[[], None]]] = {}  # in deadline order
        self._sweep: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the sweep's

    def add(self, key: Hashable, expire: Callable[[], None]) -> None:
        loop = asyncio.get_running_loop()
        self._calls[key] = (loop.time() + self.seconds, expire)
        if self._sweep is None or self._loop is not loop:  # (a closed loop's sweep never comes)
            self._loop = loop
            self._sweep = loop.call_later(self.period, self._expire, loop)

    def discard(self, key: Hashable) -> None:
        self._calls.pop(key, None)

    def __len__(self) -> int:
        return len(self._calls)

    def _expire(self, loop: asyncio.AbstractEventLoop) -> None:
        if loop is not self._loop:  # a sweep of a loop this was used on before
            return
        now = loop.time()
        expired = []
        for key, (deadline, expire) in self._calls.items():
            if deadline > now:
                break
            expired.append((key, expire))
        for key, _ in expired:
            del self._calls[key]
        self._sweep = loop.call_later(self.period, self._expire, loop) if self._calls else None
        for _, expire in expired:
            try:
                expire()
            except Exception:  # one call's failure to stop must not spare the others
                logger.exception("a call's expiry failed")

    def close(self) -> None:
        """Stops the sweep; calls still running have no deadline any more."""
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        self._calls.clear()
