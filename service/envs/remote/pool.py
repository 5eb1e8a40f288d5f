"""A pool of env servers: placement of new sessions on the least-loaded healthy server under a
per-server cap, health checks that take a failing server out of placement until it answers again,
and per-server metrics (sessions open, calls, latency, errors by kind)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
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


class PoolMetrics:
    """Per-server series in the app's registry: rollout_env_server_*{env, server}."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        registry = registry if registry is not None else CollectorRegistry()
        labels = ["env", "server"]
        self.sessions_open = Gauge(
            "rollout_env_server_sessions_open", "Sessions open on the env server.", labels, registry=registry
        )
        self.up = Gauge(
            "rollout_env_server_up",
            "1 while the env server is in placement, 0 while it is down.",
            labels,
            registry=registry,
        )
        self.calls = Counter(
            "rollout_env_server_calls",
            "Calls to the env server, by kind.",
            [*labels, "call"],
            registry=registry,
        )
        self.latency = Histogram(
            "rollout_env_server_call_seconds",
            "Latency of calls to the env server (reset, step, tool list, open).",
            labels,
            buckets=CALL_BUCKETS_SECONDS,
            registry=registry,
        )
        self.errors = Counter(
            "rollout_env_server_errors",
            f"Failed calls to the env server, by kind ({', '.join(ERROR_KINDS)}).",
            [*labels, "kind"],
            registry=registry,
        )


@dataclass(eq=False)
class Server:
    """One env server of a pool, as placement sees it."""

    url: str
    cap: int  # sessions in flight at most
    sessions: int = 0  # open now
    down: str | None = None  # why it is out of placement; None while healthy
    failed_checks: int = 0  # health checks failed in a row
    calls: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    # Its labelled metric series, looked up once: labels() per call was a measured share of the
    # service's CPU per env call (a dict lookup under a lock, per series, per call).
    call_counters: dict[str, Any] = field(default_factory=dict)  # call kind -> Counter child
    latency: Any = None  # its Histogram child
    sessions_gauge: Any = None  # its sessions_open child (set at each acquire and release)

    @property
    def healthy(self) -> bool:
        return self.down is None

    def describe(self) -> str:
        return "ok" if self.down is None else f"down: {self.down}"


class CallTimer:
    """Observes a call's latency in the server's histogram (a plain class: one per env call, where
    a generator-based context manager cost more CPU, profiled; `with` or `async with`)."""

    __slots__ = ("_histogram", "_started")

    def __init__(self, histogram: Histogram) -> None:
        self._histogram = histogram
        self._started = 0.0

    def __enter__(self) -> None:
        self._started = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self._histogram.observe(time.perf_counter() - self._started)

    async def __aenter__(self) -> None:
        self.__enter__()

    async def __aexit__(self, *exc: object) -> None:
        self.__exit__()


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
        self.metrics = metrics
        self.health_interval_seconds = health_interval_seconds
        self.placement_timeout_seconds = placement_timeout_seconds
        self._health_check = health_check
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._turns = itertools.count()
        self._checker: asyncio.Task[None] | None = None
        for server in self.servers:
            metrics.up.labels(env, server.url).set(1)
            server.sessions_gauge = metrics.sessions_open.labels(env, server.url)
            server.sessions_gauge.set(0)

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
        server.sessions_gauge.set(server.sessions)
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
        server.sessions_gauge.set(server.sessions)
        self._wake(1)

    def call(self, server: Server, what: str) -> CallTimer:
        """Counts and times one call to `server` (`async with pool.call(server, "step"): ...`)."""
        server.calls += 1
        counter = server.call_counters.get(what)
        if counter is None:
            counter = server.call_counters[what] = self.metrics.calls.labels(self.env, server.url, what)
        counter.inc()
        if server.latency is None:
            server.latency = self.metrics.latency.labels(self.env, server.url)
        return CallTimer(server.latency)

    def failed(self, server: Server, kind: str, reason: str) -> None:
        """Counts an error of `kind`; a server that cannot be reached leaves placement until its
        health check passes."""
        server.errors[kind] = server.errors.get(kind, 0) + 1
        self.metrics.errors.labels(self.env, server.url, kind).inc()
        if kind in ("connect", "closed", "timeout") and server.down is None:
            self.mark_down(server, f"{kind}: {reason}")

    def mark_down(self, server: Server, reason: str) -> None:
        if server.down is None:
            logger.warning("env server %s of %s is down: %s", server.url, self.env, reason)
        server.down = reason
        self.metrics.up.labels(self.env, server.url).set(0)

    async def _mark_up(self, server: Server) -> None:
        logger.info("env server %s of %s is back", server.url, self.env)
        server.down = None
        self.metrics.up.labels(self.env, server.url).set(1)
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
        """Checks every server once: a failing one leaves placement, a passing one returns."""
        results = await asyncio.gather(
            *(self._health_check(s.url) for s in self.servers), return_exceptions=True
        )
        for server, result in zip(self.servers, results, strict=True):
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
