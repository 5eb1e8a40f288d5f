"""Stragglers: how soon an asynchronous trainer has K complete groups in hand.

A batch of G groups x 8 `builtin/shop` episodes runs through the service (in this process) against
the simulated SGLang worker (its own thread); 5% of the episodes (chosen by id) take 20x longer per
call. A trainer takes K complete groups three ways, each on a fresh database:

- `whole_batch`: GET /batches/{id}?wait= until the batch is complete, then takes K groups (a
  synchronous trainer);
- `stream`: follows GET /groups?after=&wait= and stops once it holds K groups;
- `stream_deadline`: the same, the batch submitted with `episode_timeout_seconds`: a straggler ends
  `truncated` at its deadline instead of holding its group.

Printed per way and K (half the groups, 90%, all): seconds from submit until the K-th group is in
hand, and the ratio against `whole_batch`.

Run from the repo root:
    .venv/bin/python bench/stragglers.py [--groups 64] [--latency 0.1] [--database sqlite]
The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402

from bench.common import fresh_database, run_loop  # noqa: E402
from service.app import create_app  # noqa: E402
from service.config import Settings  # noqa: E402
from service.serving import serve_app  # noqa: E402
from service.sim.worker import SimConfig, SimWorker, create_sim_app, serve_in_thread  # noqa: E402

SAMPLES = 8  # per task: a GRPO group
SLOW_RATE, SLOW_FACTOR = 0.05, 20.0
GOAL = "K complete groups through /groups, with a deadline, long before the whole batch completes"


async def take_groups(
    database_url: str, groups: int, latency: float, way: str, deadline: float | None
) -> dict[str, Any]:
    """Seconds from submit until each count of complete groups was in hand, this way."""
    sim = SimWorker(
        SimConfig(
            latency_seconds=latency,
            slow_episode_rate=SLOW_RATE,
            slow_episode_factor=SLOW_FACTOR,
            malformed_call_rate=0.0,
        )
    )
    with serve_in_thread(create_sim_app(sim.config, worker=sim)) as sim_url:
        settings = Settings(database_url=database_url, sglang_url=sim_url, api_keys="", log_level="WARNING")  # type: ignore[call-arg]
        async with (
            serve_app(create_app(settings)) as url,
            httpx.AsyncClient(base_url=url, timeout=600) as http,
        ):
            body: dict[str, Any] = {
                "batch_id": "stragglers",
                "env": "builtin/shop",
                "task_split": "train",
                "task_indices": list(range(groups)),
                "samples_per_task": SAMPLES,
                "sampling_params": {"temperature": 1.0, "max_new_tokens": 256},
                "max_turns": 30,
                "episode_timeout_seconds": deadline,
            }
            started = time.monotonic()
            assert (await http.post("/episodes", json=body)).status_code == 202
            in_hand: list[float] = []  # seconds at which the 1st, 2nd... group arrived
            if way == "whole_batch":
                batch = (await http.get("/batches/stragglers", params={"wait": 1800})).json()
                assert batch["complete"]
                in_hand = [time.monotonic() - started] * batch["groups_complete"]
            else:
                cursor = 0
                while len(in_hand) < groups:
                    page = (await http.get("/groups", params={"after": cursor, "wait": 30})).json()
                    in_hand += [time.monotonic() - started] * len(page["groups"])
                    cursor = page["next"]
            batch = (await http.get("/batches/stragglers")).json()
    return {
        "seconds_to_groups": in_hand,
        "truncated_at_deadline": sum(
            1 for e in batch["episodes"] if (e["error"] or "").startswith("deadline")
        ),
        "counts": {status: count for status, count in batch["counts"].items() if count},
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--latency", type=float, default=0.1, help="the simulated engine's seconds per call")
    parser.add_argument(
        "--deadline", type=float, default=None, help="episode_timeout_seconds (default: 60 calls' latency)"
    )
    parser.add_argument("--database", choices=["sqlite", "postgres"], default="sqlite")
    args = parser.parse_args(argv)
    deadline = args.deadline if args.deadline is not None else 60 * args.latency
    wanted = sorted({max(1, args.groups // 2), max(1, args.groups * 9 // 10), args.groups})
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for way, timeout in (("whole_batch", None), ("stream", None), ("stream_deadline", deadline)):
            with fresh_database(args.database, Path(tmp), migrate=True) as url:
                run = run_loop(take_groups(url, args.groups, args.latency, way, timeout))
            times = run.pop("seconds_to_groups")
            run["seconds_to_k_groups"] = {str(k): round(times[k - 1], 2) for k in wanted}
            runs[way] = run
            print(way, json.dumps(run), flush=True)
    whole = runs["whole_batch"]["seconds_to_k_groups"]
    result = {
        "bench": "stragglers",
        "database": args.database,
        "groups": args.groups,
        "samples": SAMPLES,
        "slow_episodes": f"{SLOW_RATE:.0%} at {SLOW_FACTOR:g}x",
        "deadline_seconds": deadline,
        "goal": GOAL,
        **runs,
        "speedup_vs_whole_batch": {
            way: {k: round(whole[k] / seconds, 2) for k, seconds in runs[way]["seconds_to_k_groups"].items()}
            for way in ("stream", "stream_deadline")
        },
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
