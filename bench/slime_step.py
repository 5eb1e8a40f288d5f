"""slime's rollout step through `rollout_client.slime.generate_rollout`: how long a step takes, and
how many requests the hook makes to take its groups.

The service runs in this process against the simulated SGLang worker (its own thread); slime is
the stand-in under tests/slime_standin (its data source, dynamic filter and output types). Each
step over-samples `builtin/shop` tasks, filters out groups whose rewards are all equal, and
returns `rollout_batch_size` groups, as slime's generate_rollout_async does. The hook takes its
groups two ways, each on a fresh database:

- `summary_polling` (the baseline, the hook before it used GET /groups): every second, each
  unfinished batch's summary; then each episode of a newly complete group by GET /episodes/{id};
- `groups_long_poll` (the hook now): GET /groups?batch_id=...&wait=, which answers as soon as a
  group completes, its episodes as Arrow.

Printed per way: seconds per step (median of the steps), requests the hook made per step, and
the bytes it read; then the ratios against the baseline.

Run from the repo root:
    .venv/bin/python bench/slime_step.py [--steps 3] [--batch-size 32] [--latency 0.05] [--database sqlite]
The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "slime_standin"))

import httpx  # noqa: E402
from rollout_client import EpisodeArrays, RolloutClient  # noqa: E402
from rollout_client import slime as hooks  # noqa: E402
from slime.rollout.data_source import RolloutDataSource  # noqa: E402
from slime.utils.types import Sample  # noqa: E402

from bench.common import fresh_database, run_loop  # noqa: E402
from service.app import create_app  # noqa: E402
from service.config import TEST_TOKENIZER_DIR, Settings  # noqa: E402
from service.serving import serve_app  # noqa: E402
from service.sim.worker import SimConfig, SimWorker, create_sim_app, serve_in_thread  # noqa: E402

SAMPLES = 8  # per task: a GRPO group
GOAL = "a step's groups taken as they complete, in a handful of requests, not polled episode by episode"


def summary_polling(
    args: Any, client: RolloutClient, submitted: list[Any], after: int
) -> tuple[list[list[Any]], int]:
    """The baseline: the hook's `_finished_groups` before GET /groups (its `consumed` counts kept
    here). Each unfinished batch's summary every POLL_SECONDS; the new complete groups' episodes
    fetched one by one."""
    finished = []
    for batch in submitted:
        if not batch.groups:
            continue
        summary = client.summary(batch.batch_id)
        if summary["groups_complete"] == CONSUMED.get(batch.batch_id, 0):
            continue
        CONSUMED[batch.batch_id] = summary["groups_complete"]
        new: dict[int, list[str]] = {}
        for episode in sorted(summary["episodes"], key=lambda e: (e["group_index"], e["sample_index"])):
            if episode["group_index"] in batch.groups:
                new.setdefault(episode["group_index"], []).append(episode["id"])
        for group_index, episode_ids in new.items():
            episodes = [EpisodeArrays.from_detail(client.episode(episode_id)) for episode_id in episode_ids]
            finished.append(hooks._fill_group(args, batch.groups.pop(group_index), episodes))
    if not finished:
        time.sleep(POLL_SECONDS)
    return finished, after


CONSUMED: dict[str, int] = {}
POLL_SECONDS = 1.0
WAYS = {"summary_polling": summary_polling, "groups_long_poll": hooks._finished_groups}


class Reads:
    """The requests the hook's blocking client sends, and the bytes it reads back."""

    def __init__(self) -> None:
        self.requests = 0
        self.bytes = 0
        self._send = httpx.Client.send

    def __enter__(self) -> Reads:
        reads = self

        def send(client: httpx.Client, request: httpx.Request, **kwargs: Any) -> httpx.Response:
            response = reads._send(client, request, **kwargs)
            reads.requests += 1
            reads.bytes += len(response.content)
            return response

        httpx.Client.send = send  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        httpx.Client.send = self._send  # type: ignore[method-assign]


def slime_args(batch_size: int) -> SimpleNamespace:
    """slime's flags as its tau-bench example sets them, at this size."""
    return SimpleNamespace(
        rollout_temperature=1.0, rollout_top_p=1.0, rollout_top_k=-1, rollout_max_response_len=256,
        rollout_stop=None, rollout_stop_token_ids=None, rollout_skip_special_tokens=False,
        rollout_batch_size=batch_size, n_samples_per_prompt=SAMPLES,
        over_sampling_batch_size=batch_size,
        dynamic_sampling_filter_path="slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std",
        reward_key=None, hf_checkpoint=str(TEST_TOKENIZER_DIR), save="/checkpoints/bench", rollout_seed=1,
    )  # fmt: skip


async def run_steps(
    database_url: str, way: str, steps: int, batch_size: int, latency: float
) -> dict[str, Any]:
    sim = SimWorker(SimConfig(latency_seconds=latency))
    with serve_in_thread(create_sim_app(sim.config, worker=sim)) as sim_url:
        settings = Settings(database_url=database_url, sglang_url=sim_url, api_keys="", log_level="WARNING")  # type: ignore[call-arg]
        async with serve_app(create_app(settings)) as url:
            os.environ.update(
                ROLLOUT_SERVICE_URL=url, ROLLOUT_ENV="builtin/shop", ROLLOUT_TASK_SPLIT="train",
                ROLLOUT_MAX_TURNS="30", ROLLOUT_RUN_ID=f"bench-{way}",
            )  # fmt: skip
            args = slime_args(batch_size)
            source = RolloutDataSource(args, [Sample(prompt=str(task)) for task in range(200)])
            seconds, requests, read = [], [], []
            hooks._finished_groups = WAYS[way]  # type: ignore[assignment]
            try:
                for step in range(steps):
                    with Reads() as reads:
                        started = time.monotonic()
                        output = await asyncio.to_thread(hooks.generate_rollout, args, step, source)
                        seconds.append(time.monotonic() - started)
                    assert len(output.samples) == batch_size
                    assert all(len({s.reward for s in group}) > 1 for group in output.samples)
                    requests.append(reads.requests)
                    read.append(reads.bytes)
            finally:
                hooks._finished_groups = WAYS["groups_long_poll"]  # type: ignore[assignment]
    return {
        "seconds_per_step": round(statistics.median(seconds), 2),
        "steps_seconds": [round(s, 2) for s in seconds],
        "requests_per_step": round(statistics.median(requests)),
        "mb_read_per_step": round(statistics.median(read) / 1e6, 2),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="slime's rollout_batch_size (groups)")
    parser.add_argument("--latency", type=float, default=0.05, help="the simulated engine's seconds per call")
    parser.add_argument("--database", choices=["sqlite", "postgres"], default="sqlite")
    args = parser.parse_args(argv)
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for way in WAYS:
            with fresh_database(args.database, Path(tmp), migrate=True) as url:
                runs[way] = run_loop(run_steps(url, way, args.steps, args.batch_size, args.latency))
            print(way, json.dumps(runs[way]), flush=True)
    base, now = runs["summary_polling"], runs["groups_long_poll"]
    result = {
        "bench": "slime_step",
        "database": args.database,
        "batch_size": args.batch_size,
        "samples": SAMPLES,
        "latency": args.latency,
        "goal": GOAL,
        **runs,
        "step_speedup": round(base["seconds_per_step"] / now["seconds_per_step"], 2),
        "fewer_requests": round(base["requests_per_step"] / max(1, now["requests_per_step"]), 1),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
