"""A pool of env servers: placement of new sessions on the least-loaded healthy server under a
per-server cap, health checks that take a failing server out of placement until it answers again,
and per-server metrics (sessions open, calls, latency, errors by kind)."""

from __future__ import annotations

import asyncio
import bisect
import collections
import contextlib
import itertools
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString
from tenacity import AsyncRetrying, RetryError, retry_if_exception_type, stop_after_attempt

from service.envs.remote.errors import EnvServerDown
from service.retries import backoff, first_then_retrying

if TYPE_CHECKING:
    from service.envs.remote.config import RemoteEnvConfig

logger = logging.getLogger(__name__)

CALL_BUCKETS_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
T = TypeVar("T")
HEALTH_FAILURES = 3  # health checks failed in a row before a server leaves placement
PLACEMENT_BACKOFF_MAX_SECONDS = 5.0  # the longest wait between two tries of a placement
ERROR_KINDS = ("connect", "timeout", "closed", "capacity", "server")


@dataclass(frozen=True)
class Series:
    """One rollout_env_server_* series: its name (a counter's without `_total`), type, help, labels."""

    name: str
    type: str
    documentation: str
    labels: tuple[str, ...]


SERVER_LABELS = ("env", "server")
SERIES = (
    Series("rollout_env_server_sessions_open", "gauge", "Sessions open on the env server.", SERVER_LABELS),
    Series(
        "rollout_env_server_up",
        "gauge",
        "1 while the env server is in placement, 0 while it is down.",
        SERVER_LABELS,
    ),
    Series(
        "rollout_env_server_calls", "counter", "Calls to the env server, by kind.", (*SERVER_LABELS, "call")
    ),
    Series(
        "rollout_env_server_call_seconds",
        "histogram",
        "Latency of calls to the env server (reset, step, tool list, open).",
        SERVER_LABELS,
    ),
    Series(
        "rollout_env_server_errors",
        "counter",
        f"Failed calls to the env server, by kind ({', '.join(ERROR_KINDS)}).",
        (*SERVER_LABELS, "kind"),
    ),
)
_FAMILIES = {"gauge": GaugeMetricFamily, "counter": CounterMetricFamily, "histogram": HistogramMetricFamily}
# The histogram's `le` labels, written as prometheus_client writes them.
_BUCKET_BOUNDS: list[str] = [
    floatToGoString(bound)  # type: ignore[no-untyped-call]
    for bound in (*CALL_BUCKETS_SECONDS, math.inf)
]


class PoolMetrics(Collector):
    """The pools' per-server series (SERIES: rollout_env_server_*{env, server}), in the app's
    registry, read at each scrape from the counts each Server keeps as plain numbers.

    Hand-written on a measured hot path (every env call): prometheus_client's labelled Counter and
    Histogram children take a lock per increment, and a histogram's observe one per bucket it walks
    (with the sessions gauge, 4.3% of the service's CPU per remote env call, perf); a Server's counts
    are only ever changed on the event loop, and a scrape copies them."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.pools: list[ServerPool] = []
        if registry is not None:
            registry.register(self)

    def describe(self) -> list[Metric]:
        return [
            _FAMILIES[series.type](series.name, series.documentation, labels=series.labels)
            for series in SERIES
        ]

    def collect(self) -> list[Metric]:
        families: list[Any] = self.describe()  # (each of its own *MetricFamily type)
        sessions, up, calls, latency, errors = families
        for pool in list(self.pools):
            for server in pool.servers:
                labels = [pool.env, server.url]
                sessions.add_metric(labels, server.sessions)
                up.add_metric(labels, 1 if server.healthy else 0)
                for kind, count in list(server.call_counts.items()):
                    calls.add_metric([*labels, kind], count)
                for kind, count in list(server.errors.items()):
                    errors.add_metric([*labels, kind], count)
                counts, total = list(server.latency_counts), server.latency_sum
                if sum(counts):
                    cumulative = list(zip(_BUCKET_BOUNDS, itertools.accumulate(counts), strict=True))
                    latency.add_metric(labels, cumulative, total)
        return [sessions, up, calls, latency, errors]


def _latency_counts() -> list[int]:
    return [0] * (len(CALL_BUCKETS_SECONDS) + 1)  # one per bucket, the last +Inf's


@dataclass(eq=False)
class Server:
    """One env server of a pool, as placement sees it, with its counts (PoolMetrics reads them)."""

    url: str
    cap: int  # sessions in flight at most
    sessions: int = 0  # open now
    down: str | None = None  # why it is out of placement; None while healthy
    failed_checks: int = 0  # health checks failed in a row
    answered: bool = False  # whether a call was answered since the last health check round
    call_counts: dict[str, int] = field(default_factory=dict)  # call kind -> calls
    errors: dict[str, int] = field(default_factory=dict)  # error kind -> failed calls
    latency_counts: list[int] = field(default_factory=_latency_counts)  # calls per latency bucket
    latency_sum: float = 0.0  # seconds, over every call

    @property
    def healthy(self) -> bool:
        return self.down is None

    def describe(self) -> str:
        return "ok" if self.down is None else f"down: {self.down}"


class CallTimer:
    """Counts a call's latency in its server's buckets, and a call that returned as the server's
    answer (a plain class: one per env call, where a generator-based context manager cost more CPU,
    profiled; `with` or `async with`)."""

    __slots__ = ("_server", "_started")

    def __init__(self, server: Server) -> None:
        self._server = server
        self._started = 0.0

    def __enter__(self) -> None:
        self._started = time.perf_counter()

    def __exit__(self, error_type: object, *exc: object) -> None:
        elapsed = time.perf_counter() - self._started
        server = self._server
        server.latency_sum += elapsed
        server.latency_counts[bisect.bisect_left(CALL_BUCKETS_SECONDS, elapsed)] += 1  # le: bound >= elapsed
        if error_type is None:
            server.answered = True

    async def __aenter__(self) -> None:
        self.__enter__()

    async def __aexit__(self, error_type: object, *exc: object) -> None:
        self.__exit__(error_type)


HealthCheck = Callable[[str], Awaitable[None]]  # raises if the server at the URL is not healthy


class ServerPool:
    """The servers of one remote env. `session()` places an episode on the least-loaded healthy
    server with a free slot (waiting up to `placement_timeout_seconds` for one), and holds the slot
    until the episode's session is closed (sticky: an episode stays on its server)."""

    def __init__(
        self,
        env: str,
        urls: list[str],
        *,
        max_sessions_per_server: int,
        health_check: HealthCheck,
        metrics: PoolMetrics,
        health_interval_seconds: float = 2.0,
        placement_timeout_seconds: float = 30.0,
    ) -> None:
        if not urls:
            raise ValueError(f"remote env {env!r} has no server URLs")
        self.env = env
        self.servers = [Server(url.rstrip("/"), max_sessions_per_server) for url in urls]
        self.health_interval_seconds = health_interval_seconds
        self.placement_timeout_seconds = placement_timeout_seconds
        self._health_check = health_check
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._turns = itertools.count()
        self._checker: asyncio.Task[None] | None = None
        metrics.pools.append(self)  # its servers' counts, read at each scrape

    @classmethod
    def of(
        cls, config: RemoteEnvConfig, servers: list[str], health_check: HealthCheck, metrics: PoolMetrics
    ) -> ServerPool:
        """The pool of a remote env (any protocol), as its config sets it."""
        return cls(
            config.name,
            servers,
            max_sessions_per_server=config.max_sessions_per_server,
            health_check=health_check,
            metrics=metrics,
            health_interval_seconds=config.health_interval_seconds,
            placement_timeout_seconds=config.placement_timeout_seconds,
        )

    # ---- Placement. ----

    def _pick(self, avoid: frozenset[str]) -> Server | None:
        free = [s for s in self.servers if s.healthy and s.sessions < s.cap and s.url not in avoid]
        if not free:
            free = [s for s in self.servers if s.healthy and s.sessions < s.cap]
        if not free:
            return None
        least = min(s.sessions for s in free)
        candidates = [s for s in free if s.sessions == least]
        return candidates[next(self._turns) % len(candidates)]  # ties in turn

    async def acquire(self, avoid: frozenset[str] = frozenset()) -> Server:
        """A slot on the least-loaded healthy server (not in `avoid` unless it is the only one);
        EnvServerDown if none frees within the placement timeout."""
        self.start()
        server = None if self._waiters else self._pick(avoid)  # first come, first placed
        if server is None:
            server = await self._wait_for_slot(avoid)
        server.sessions += 1
        return server

    async def _wait_for_slot(self, avoid: frozenset[str]) -> Server:
        # A queue of waiters, each woken alone when one slot frees: a condition's notify_all woke
        # every waiter per release (quadratic at thousands waiting: a fifth of the CPU, profiled).
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.placement_timeout_seconds):
                first = True
                while True:
                    waiter = loop.create_future()
                    if first:
                        self._waiters.append(waiter)
                    else:  # woken, but the slot was taken (its server went down): still first
                        self._waiters.appendleft(waiter)
                    first = False
                    try:
                        await waiter
                    except BaseException:
                        if waiter.cancelled():
                            with contextlib.suppress(ValueError):  # unless _wake dropped it
                                self._waiters.remove(waiter)
                        else:  # woken, then cancelled: the slot goes to the next in line
                            self._wake(1)
                        raise
                    if (server := self._pick(avoid)) is not None:
                        return server
        except TimeoutError:
            raise EnvServerDown(
                f"no server of remote env {self.env!r} could take an episode within "
                f"{self.placement_timeout_seconds:g} s: {self.describe()}"
            ) from None

    def _wake(self, count: int) -> None:
        while count > 0 and self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():  # (a cancelled one leaves the queue when its task resumes)
                waiter.set_result(None)
                count -= 1

    async def release(self, server: Server) -> None:
        server.sessions -= 1
        self._wake(1)

    def call(self, server: Server, what: str) -> CallTimer:
        """Counts and times one call to `server` (`async with pool.call(server, "step"): ...`)."""
        counts = server.call_counts
        counts[what] = counts.get(what, 0) + 1
        return CallTimer(server)

    def failed(self, server: Server, kind: str, reason: str) -> None:
        """Counts an error of `kind`; a server that cannot be reached leaves placement until its
        health check passes."""
        server.errors[kind] = server.errors.get(kind, 0) + 1
        if kind in ("connect", "closed", "timeout") and server.down is None:
            self.mark_down(server, f"{kind}: {reason}")

    def mark_down(self, server: Server, reason: str) -> None:
        if server.down is None:
            logger.warning("env server %s of %s is down: %s", server.url, self.env, reason)
        server.down = reason

    async def _mark_up(self, server: Server) -> None:
        logger.info("env server %s of %s is back", server.url, self.env)
        server.down = None
        self._wake(len(self._waiters))

    def describe(self) -> str:
        return "; ".join(f"{s.url} {s.describe()} ({s.sessions}/{s.cap} sessions)" for s in self.servers)

    async def place(
        self, attempt: Callable[[Server], Awaitable[T]], *, retries: int, backoff_seconds: float
    ) -> T:
        """`attempt(server)` on a slot of the least-loaded healthy server, tried `retries + 1` times
        at most, each on a server not tried yet while there is one, waiting the service's backoff
        between (from `backoff_seconds`). The slot stays held once an attempt returns. An attempt
        that raises EnvServerDown (made by errors.server_failure: the call did not take effect)
        frees its slot, counts as a failure of its kind on the server, and is tried again; any
        other exception frees the slot and ends the placement. EnvServerDown once every try failed."""
        tried: set[str] = set()

        async def placed() -> T:
            server = await self.acquire(frozenset(tried))
            try:
                return await attempt(server)
            except BaseException as error:
                await self.release(server)
                if isinstance(error, EnvServerDown):
                    self.failed(server, error.kind, error.how)
                    tried.add(server.url)
                raise

        def retrying() -> AsyncRetrying:
            return AsyncRetrying(
                stop=stop_after_attempt(retries + 1),
                wait=backoff(backoff_seconds, PLACEMENT_BACKOFF_MAX_SECONDS),
                retry=retry_if_exception_type(EnvServerDown),
            )

        try:
            return await first_then_retrying(placed, retrying)
        except RetryError as failed:
            raise EnvServerDown(
                f"no server of {self.env!r} took the episode after {retries + 1} tries; "
                f"last: {failed.last_attempt.exception()}; {self.describe()}"
            ) from None

    # ---- Health checks. ----

    def start(self) -> None:
        if self._checker is None:
            self._checker = asyncio.get_running_loop().create_task(self._check_forever())

    async def check(self) -> None:
        """Checks every server once: a failing one leaves placement, a passing one returns. A
        server in placement that answered a call since the last round is not probed: its answer
        says as much as the probe would (a probe a round per server and service process was 4% of
        the service's CPU per remote env call at 2,000 episodes in flight, perf; an MCP server's is
        a whole session handshake). After a failed call, or none, the server is probed again."""
        probed = []
        for server in self.servers:
            if server.answered and server.down is None:
                server.failed_checks = 0
            else:
                probed.append(server)
            server.answered = False
        results = await asyncio.gather(*(self._health_check(s.url) for s in probed), return_exceptions=True)
        for server, result in zip(probed, results, strict=True):
            if isinstance(result, BaseException):
                server.failed_checks += 1
                # A busy server may miss one probe; HEALTH_FAILURES in a row take it out.
                if server.failed_checks >= HEALTH_FAILURES or server.down is not None:
                    self.mark_down(server, f"health check failed: {type(result).__name__}: {result}")
                continue
            server.failed_checks = 0
            if server.down is not None:
                await self._mark_up(server)

    async def _check_forever(self) -> None:
        while True:
            # Jittered, so that many service processes do not probe in step.
            await asyncio.sleep(self.health_interval_seconds * random.uniform(0.8, 1.2))
            try:
                await self.check()
            except Exception:  # a probe must never end the checker
                logger.exception("health check of %s failed", self.env)

    async def close(self) -> None:
        if self._checker is not None:
            self._checker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._checker
            self._checker = None
