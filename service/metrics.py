"""Prometheus metrics, in a registry of the app's own (several apps may live in one process).

Under `serve --workers N` every process writes its values to files in one directory
(prometheus_client's multiprocess mode, PROMETHEUS_MULTIPROC_DIR, set by the supervisor before it
starts them), and /metrics, whichever process answers it, renders the host's sum: counters and
histograms summed over every process that ran (a replaced process's counts stay), the in-flight
gauges summed over the live ones, and the database's readings as the answering process takes them."""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST as PROMETHEUS_MEDIA_TYPE
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from service.records import DEADLINE_NOTE, EpisodeResult, EpisodeStatus

# A young collection takes well under a millisecond; a full one over thousands of live episodes, seconds.
GC_PAUSE_BUCKETS_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
LATENCY_BUCKETS_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

# prometheus_client reads it when first imported: a process must have it in its environment from start.
MULTIPROCESS_DIR_VARIABLE = "PROMETHEUS_MULTIPROC_DIR"

__all__ = ["MULTIPROCESS_DIR_VARIABLE", "PROMETHEUS_MEDIA_TYPE", "Metrics", "clear_multiprocess_dir"]


def clear_multiprocess_dir(directory: Path) -> None:
    """Empties (creating it if need be) a directory of multiprocess values before a run: what an
    earlier run left there would otherwise be added to this one's counts."""
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob("*.db"):
        stale.unlink()


class Metrics:
    def __init__(self) -> None:
        self.multiprocess_dir = os.environ.get(MULTIPROCESS_DIR_VARIABLE) or None
        self.registry = CollectorRegistry()
        registry = self.registry
        self.submitted = Counter(
            "rollout_episodes_submitted", "Episodes accepted by POST /episodes.", registry=registry
        )
        self.finished = Counter(
            "rollout_episodes_finished",
            "Episodes this process finished, by status.",
            ["status"],
            registry=registry,
        )
        self.cancelled = Counter(
            "rollout_episodes_cancelled",
            "Episodes ended cancelled by POST /batches/{id}/cancel through this process.",
            ["when"],
            registry=registry,
        )
        for when in ("queued", "running"):
            self.cancelled.labels(when)
        self.turns = Counter("rollout_turns", "Generate calls of finished episodes.", registry=registry)
        self.past_deadline = Counter(
            "rollout_episodes_past_deadline",
            "Episodes ended truncated by their episode_timeout_seconds.",
            registry=registry,
        )
        self.groups_completed = Counter(
            "rollout_groups_completed",
            "Groups this process logged complete in the stream of GET /groups.",
            registry=registry,
        )
        self.groups_filtered = Counter(
            "rollout_groups_filtered",
            "Complete groups that pages of GET /groups served here skipped for min_reward_std.",
            registry=registry,
        )
        self.resumes = Counter(
            "rollout_turn_resumes",
            "Generate calls of finished episodes that resumed a turn the engine aborted.",
            registry=registry,
        )
        self.tokens = Counter(
            "rollout_tokens",
            "Tokens of finished episodes: prompt, sampled, context.",
            ["kind"],
            registry=registry,
        )
        self.engine_prompt_tokens = Counter(
            "rollout_engine_prompt_tokens",
            "Prompt tokens of the generate calls of finished episodes: all, and those the engine's prefix "
            "cache served (SGLang's meta_info.cached_tokens).",
            ["kind"],
            registry=registry,
        )
        self.prefix_cache_hit_rate = Gauge(
            "rollout_prefix_cache_hit_rate",
            "Share of prompt tokens served from the engine's prefix cache (cached / all, above), in the "
            "process that answered last under `serve --workers N`: for the host's, rate() the counters.",
            registry=registry,
            multiprocess_mode="mostrecent",
        )
        self._prompt_tokens = self._cached_tokens = 0  # the two series above, for the rate
        self.engine_seconds = Histogram(
            "rollout_engine_seconds", "Duration of one /generate call.", buckets=LATENCY_BUCKETS_SECONDS,
            registry=registry,
        )  # fmt: skip
        self.env_seconds = Histogram(
            "rollout_env_seconds", "Duration of one environment step.", buckets=LATENCY_BUCKETS_SECONDS,
            registry=registry,
        )  # fmt: skip
        # Readings of the database, the same from any process: the one answering the scrape took
        # them last ("mostrecent" across processes).
        self.episodes = Gauge(
            "rollout_episodes", "Episodes in the database, by status.", ["status"], registry=registry,
            multiprocess_mode="mostrecent",
        )  # fmt: skip
        self.queue_depth = Gauge(
            "rollout_queue_depth", "Episodes waiting to be claimed.", registry=registry,
            multiprocess_mode="mostrecent",
        )  # fmt: skip
        self.outstanding = Gauge(
            "rollout_episodes_outstanding",
            "Episodes queued or running, in the whole database: the demand worker replicas scale on "
            "(a HorizontalPodAutoscaler's external metric, divided by MAX_RUNNING_EPISODES per replica).",
            registry=registry,
            multiprocess_mode="mostrecent",
        )
        # This host's processes: summed over the live ones.
        self.inflight_episodes = Gauge(
            "rollout_inflight_episodes", "Episodes running in this host's processes.", registry=registry,
            multiprocess_mode="livesum",
        )  # fmt: skip
        self.inflight_generates = Gauge(
            "rollout_inflight_generates", "/generate calls in flight from this host's processes.",
            registry=registry, multiprocess_mode="livesum",
        )  # fmt: skip
        self.engine_paused = Gauge(
            "rollout_engine_paused",
            "1 while generation is paused (POST /engine/pause, until /engine/continue or MAX_PAUSE_SECONDS).",
            registry=registry,
            multiprocess_mode="livemax",
        )
        self.gc_pause_seconds = Histogram(
            "rollout_gc_pause_seconds",
            "Duration of one garbage collection in this process, by generation (2: a full one), "
            "during which its event loop stands still (see TUNE_GC).",
            ["generation"],
            buckets=GC_PAUSE_BUCKETS_SECONDS,
            registry=registry,
        )
        for generation in range(3):
            self.gc_pause_seconds.labels(str(generation))
        for status in EpisodeStatus:
            if status.finished:  # queued and running are not outcomes: no always-zero series for them
                self.finished.labels(status.value)

    def watch_collections(self) -> Callable[[], None]:
        """Times each garbage collection of the process (gc.callbacks) into rollout_gc_pause_seconds
        until the returned function is called."""
        pauses = [self.gc_pause_seconds.labels(str(generation)) for generation in range(3)]
        started = 0.0

        def on_collection(phase: str, info: dict[str, Any]) -> None:
            nonlocal started
            if phase == "start":
                started = time.perf_counter()
            else:
                pauses[info["generation"]].observe(time.perf_counter() - started)

        gc.callbacks.append(on_collection)
        return lambda: gc.callbacks.remove(on_collection)

    def episodes_submitted(self, count: int) -> None:
        self.submitted.inc(count)

    def episodes_cancelled(self, queued: int, running: int) -> None:
        self.cancelled.labels("queued").inc(queued)
        self.cancelled.labels("running").inc(running)
        self.finished.labels("cancelled").inc(queued + running)  # a cancel is how they finished

    def episode_finished(self, result: EpisodeResult) -> None:
        self.finished.labels(result.status.value).inc()
        self.turns.inc(len(result.turns))
        self.resumes.inc(len(result.turns) - result.num_turns)
        if result.error is not None and result.error.startswith(DEADLINE_NOTE):
            self.past_deadline.inc()
        if (tokens := result.tokens) is not None:
            sampled = sum(tokens.loss_mask)
            self.tokens.labels("prompt").inc(len(tokens.prompt_ids))
            self.tokens.labels("sampled").inc(sampled)
            self.tokens.labels("context").inc(len(tokens.response_ids) - sampled)
        prompt = cached = 0
        for turn in result.turns:
            prompt += turn.prompt_tokens or 0
            cached += turn.cached_tokens or 0
            self.engine_seconds.observe(turn.engine_seconds)
            if turn.action is not None:
                self.env_seconds.observe(turn.env_seconds)
        self.engine_prompt_tokens.labels("all").inc(prompt)
        self.engine_prompt_tokens.labels("cached").inc(cached)
        self._prompt_tokens += prompt
        self._cached_tokens += cached

    def agent_finished(self, status: EpisodeStatus) -> None:
        """An external agent's episode, ended by its agent (its turns and tokens are not counted)."""
        self.finished.labels(status.value).inc()

    def render(
        self,
        episodes_by_status: Mapping[str, int],
        inflight_episodes: int,
        inflight_generates: int,
        *,
        paused: bool,
    ) -> bytes:
        """The text format, with the gauges set from these readings of the database and the process."""
        for status, count in episodes_by_status.items():
            self.episodes.labels(status).set(count)
        queued = episodes_by_status.get(EpisodeStatus.QUEUED.value, 0)
        self.queue_depth.set(queued)
        self.outstanding.set(queued + episodes_by_status.get(EpisodeStatus.RUNNING.value, 0))
        self.inflight_episodes.set(inflight_episodes)
        self.inflight_generates.set(inflight_generates)
        self.engine_paused.set(int(paused))
        if self._prompt_tokens:
            self.prefix_cache_hit_rate.set(self._cached_tokens / self._prompt_tokens)
        if self.multiprocess_dir is None:
            return generate_latest(self.registry)
        host = CollectorRegistry()
        MultiProcessCollector(host, self.multiprocess_dir)  # type: ignore[no-untyped-call]
        return generate_latest(host)
