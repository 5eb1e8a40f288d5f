"""Which engine worker serves a generate call, so the worker's prefix cache holds its prompt.

Every turn of an episode resends the whole conversation; SGLang serves the part it has already
seen from its radix cache only on the worker that saw it. Sticky placement keeps every call of an
episode on one worker, and starts a GRPO group's episodes (which share their prompt) on the
group's worker while that worker is not much busier than the least busy one. A worker that fails
(no connection, 5xx) is left alone for a while: its episodes move to another worker on their next
call, the failed call included (the client's retry), and the move costs one uncached prompt.

Through the SGLang router, the same keys travel as its routing key (ROUTING_KEY_HEADER): the
router's `manual` policy pins a key to one worker.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Literal

PlacementMode = Literal["sticky", "round_robin", "router"]

# sglang-router 0.3.2 (and SMG after it) reads a request's routing key from this header; its
# `manual` policy pins each key to one worker.
ROUTING_KEY_HEADER = "X-SMG-Routing-Key"
PINNED_EPISODES = 200_000  # episodes remembered (least recently used forgotten first)
PINNED_GROUPS = 50_000
WORKER_DOWN_SECONDS = 5.0  # a failed worker gets no new calls for this long
# A group's next episode joins the group's worker while that worker has at most this many more
# calls in flight than the least busy worker (or this share of the mean, if more).
GROUP_SLACK_CALLS = 8
GROUP_SLACK_SHARE = 0.25


@dataclass(frozen=True)
class Route:
    """What an episode's calls are placed by: the episode, and its group (None: no group)."""

    episode: str
    group: str | None = None


# Set by whoever runs an episode (the worker) for the engine calls made under it.
current_route: ContextVar[Route | None] = ContextVar("current_route", default=None)


def episode_key(rid: str) -> str:
    """The episode of a rid "<episode_id>:<attempt>:<turn>[.suffix]" (the whole rid if not ours):
    a retried attempt goes back to the worker that holds its prompt."""
    return rid.split(":", 1)[0] if rid.count(":") >= 2 else rid


def route_of(rid: str) -> Route:
    route = current_route.get()
    return route if route is not None else Route(episode_key(rid))


def routing_key(route: Route) -> str:
    """The router's key: the group's, so its samples share the cached prompt; else the episode's."""
    return route.group if route.group is not None else route.episode


class Placement:
    """Places generate calls on `urls`: sticky (per episode, per group while its load allows) or
    round-robin (per call; the baseline the prefix-cache bench compares against)."""

    def __init__(self, urls: list[str], mode: PlacementMode = "sticky") -> None:
        if not urls:
            raise ValueError("placement needs at least one worker URL")
        self.urls = list(urls)
        self.sticky = mode == "sticky"
        self.inflight = dict.fromkeys(self.urls, 0)
        self._down_until = dict.fromkeys(self.urls, 0.0)
        self._episodes: OrderedDict[str, str] = OrderedDict()
        self._groups: OrderedDict[str, str] = OrderedDict()
        self._turn = itertools.cycle(range(len(self.urls)))
        self.moves = 0  # episodes moved off a failed worker

    def pick(self, route: Route) -> str:
        """The worker for the next call of `route`'s episode."""
        if not self.sticky:
            return self._least_busy(round_robin=True)
        now = time.monotonic()
        url = self._episodes.get(route.episode)
        if url is not None:
            if self._down_until[url] <= now:
                self._episodes.move_to_end(route.episode)
                return url
            self.moves += 1
        url = self._group_worker(route.group, now) or self._least_busy()
        _remember(self._episodes, route.episode, url, PINNED_EPISODES)
        if route.group is not None:
            _remember(self._groups, route.group, url, PINNED_GROUPS)
        return url

    def _group_worker(self, group: str | None, now: float) -> str | None:
        url = self._groups.get(group) if group is not None else None
        if url is None or self._down_until[url] > now:
            return None
        loads = self.inflight.values()
        slack = max(GROUP_SLACK_CALLS, GROUP_SLACK_SHARE * sum(loads) / len(self.urls))
        return url if self.inflight[url] - min(loads) <= slack else None

    def _least_busy(self, *, round_robin: bool = False) -> str:
        """The least busy worker that is up (ties in turn); if none is up, the one back soonest.
        With `round_robin`, simply the next worker that is up."""
        now = time.monotonic()
        start = next(self._turn)
        order = self.urls[start:] + self.urls[:start]
        up = [url for url in order if self._down_until[url] <= now]
        if not up:
            return min(order, key=self._down_until.__getitem__)
        if round_robin:
            return up[0]
        return min(up, key=self.inflight.__getitem__)

    def started(self, url: str) -> None:
        self.inflight[url] += 1

    def finished(self, url: str) -> None:
        self.inflight[url] -= 1

    def failed(self, url: str) -> None:
        """`url` failed a call (no connection, 5xx): no calls go to it for WORKER_DOWN_SECONDS."""
        self._down_until[url] = time.monotonic() + WORKER_DOWN_SECONDS

    def up(self, url: str) -> bool:
        return self._down_until[url] <= time.monotonic()


def _remember(pins: OrderedDict[str, str], key: str, url: str, limit: int) -> None:
    pins[key] = url
    pins.move_to_end(key)
    if len(pins) > limit:
        pins.popitem(last=False)
