"""Weight updates during a batch, as slime makes them: how much work they cost.

N episodes run through the service (in this process) against the simulated SGLang worker (its own
thread), whose requests decode token by token so that an abort cuts them mid-turn. K times, a
trainer's weight sync runs as slime's does at the end of a rollout step: `abort_servers_until_idle`
(POST /abort_request {"abort_all": true}, then GET /v1/loads, again every 3 s while requests
remain), then new weights (a new weight version). The same batch runs twice: with resumed turns
(MAX_TURN_RESUMES=8, the default) and without (MAX_TURN_RESUMES=0: an abort ends the episode, as
before resumes existed). Measured: episodes lost (ended aborted or failed; the simulated policy
makes no mistakes here, so every one is the updates'), tokens sampled twice (sampled by the engine
but not in the stored episode: re-runs and lost turns), whole-episode re-runs, the abort loops'
rounds and seconds, and the time from the last update to the batch complete.

Run from the repo root:
    .venv/bin/python bench/weight_update.py [--episodes 512] [--updates 3] [--database sqlite]
The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "slime_standin"))

import httpx  # noqa: E402
from slime.backends.sglang_utils.server_control import abort_servers_until_idle  # noqa: E402
from sqlalchemy import select  # noqa: E402

from bench.common import fresh_database, run_loop  # noqa: E402
from service.app import create_app  # noqa: E402
from service.config import Settings  # noqa: E402
from service.serving import serve_app  # noqa: E402
from service.sim.worker import SimConfig, SimWorker, create_sim_app, serve_in_thread  # noqa: E402
from service.storage.db import Database  # noqa: E402
from service.storage.models import Episode  # noqa: E402

SAMPLES = 8  # per task: a GRPO group
SLIME_ABORT_RETRY_SECONDS = 3.0
IN_FLIGHT_TIMEOUT_SECONDS = 60.0  # from the submit until some turn is at the engine
BATCH_ID = "weights"
GOAL = "0 episodes lost and 0 tokens sampled twice across the weight updates"


def sampled_by_engine(sims: list[SimWorker]) -> dict[str, int]:
    """Output tokens the engine returned, per episode id."""
    counts: dict[str, int] = {}
    for request in (request for sim in sims for request in sim.requests):
        if request.response_body is not None:
            tokens = json.loads(request.response_body)["meta_info"]["completion_tokens"]
            episode_id = request.rid.split(":")[0]
            counts[episode_id] = counts.get(episode_id, 0) + tokens
    return counts


async def wait_for_a_turn_in_flight(sims: list[SimWorker], http: httpx.AsyncClient, deadline: float) -> bool:
    """Until a turn is at an engine (True), or the batch has finished or the deadline passed (False:
    without resumes, the first update can fail every episode, and nothing is left to cut)."""
    # The simulated workers serve from their own threads: polled, as no event of this loop can tell.
    polls = 0
    while not any(sim.running for sim in sims):
        polls += 1
        if time.monotonic() >= deadline:
            return False
        if polls % 20 == 0 and (await http.get(f"/batches/{BATCH_ID}")).json()["complete"]:
            return False
        await asyncio.sleep(0.01)
    return True


async def abort_what_runs(
    sims: list[SimWorker], urls: list[str], http: httpx.AsyncClient, deadline: float
) -> dict[str, Any]:
    """slime's abort loop once a turn is at an engine, again if it cut nothing (the turn seen in
    flight ended before the abort came: a loaded machine's window), until it cut one or nothing is
    left to cut. Its rounds and seconds, those of the tries together."""
    started, rounds = time.monotonic(), 0
    while await wait_for_a_turn_in_flight(sims, http, deadline):
        before = sum(sim.aborted for sim in sims)
        rounds += max(await abort_servers_until_idle(urls, SLIME_ABORT_RETRY_SECONDS))
        if sum(sim.aborted for sim in sims) > before:
            break
    return {"rounds": rounds, "seconds": round(time.monotonic() - started, 2)}


async def run_batch(
    database_url: str,
    episodes: int,
    updates: int,
    interval: float,
    latency: float,
    resumes: int,
    workers: int,
) -> dict[str, Any]:
    config = SimConfig(latency_seconds=latency, per_token_latency_seconds=0.004, malformed_call_rate=0.0)
    sims = [SimWorker(config) for _ in range(workers)]
    with ExitStack() as stack:
        urls = [stack.enter_context(serve_in_thread(create_sim_app(config, worker=sim))) for sim in sims]
        # Several workers: the service places each episode's calls on one (sticky placement).
        settings = Settings(
            database_url=database_url,
            sglang_url=urls[0],
            sglang_worker_urls=",".join(urls) if workers > 1 else "",
            api_keys="",
            max_turn_resumes=resumes,
            log_level="WARNING",
        )  # type: ignore[call-arg]
        async with (
            serve_app(create_app(settings)) as url,
            httpx.AsyncClient(base_url=url, timeout=600) as http,
        ):
            body = {
                "batch_id": BATCH_ID,
                "env": "builtin/shop",
                "task_split": "train",
                "task_indices": list(range(episodes // SAMPLES)),
                "samples_per_task": SAMPLES,
                "sampling_params": {"temperature": 1.0, "max_new_tokens": 256},
                "max_turns": 30,
            }
            assert (await http.post("/episodes", json=body)).status_code == 202
            submitted = time.monotonic()
            loops = []
            for version in range(1, updates + 1):
                await asyncio.sleep(interval)
                # An update cuts the turns in flight: it waits for one (a loaded machine may still be
                # claiming), so that every update cuts something and the figures are never empty.
                loops.append(await abort_what_runs(sims, urls, http, submitted + IN_FLIGHT_TIMEOUT_SECONDS))
                for sim in sims:
                    sim.update_weights(str(version), abort_all=False)
            last_update = time.monotonic()
            batch = (await http.get(f"/batches/{BATCH_ID}", params={"wait": 1800})).json()
            tail = time.monotonic() - last_update
    database = Database.open(database_url)
    try:
        async with database.sessionmaker() as session:
            stored = list(await session.scalars(select(Episode).where(Episode.batch_id == BATCH_ID)))
    finally:
        await database.dispose()
    engine_tokens = sampled_by_engine(sims)
    kept = {episode.id: sum(episode.tokens().loss_mask) if episode.tokens() else 0 for episode in stored}
    resumed_calls = sum(
        sum(1 for turn in episode.turns or [] if turn.get("resume", 0) > 0) for episode in stored
    )
    return {
        "complete": batch["complete"],
        "counts": {status: count for status, count in batch["counts"].items() if count},
        "episodes_lost": batch["counts"]["aborted"] + batch["counts"]["failed"],
        "tokens_sampled_twice": sum(engine_tokens.values()) - sum(kept.values()),
        "tokens_sampled": sum(engine_tokens.values()),
        "tokens_in_lost_episodes": sum(
            kept[episode.id] for episode in stored if episode.status in ("aborted", "failed")
        ),
        "whole_episode_reruns": sum(1 for episode in stored if episode.attempt > 0),
        "resumed_calls": resumed_calls,
        "requests_cut": sum(sim.aborted for sim in sims),
        "abort_loops": loops,
        "seconds_from_last_update_to_complete": round(tail, 2),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--episodes", type=int, default=512)
    parser.add_argument("--updates", type=int, default=3)
    parser.add_argument("--interval", type=float, default=1.5, help="seconds between weight updates")
    parser.add_argument("--latency", type=float, default=0.4, help="the simulated engine's seconds per call")
    parser.add_argument("--database", choices=["sqlite", "postgres"], default="sqlite")
    parser.add_argument("--workers", type=int, default=1, help="simulated workers (more: sticky placement)")
    parser.add_argument(
        "--resumed-only", action="store_true", help="skip the run without resumes (the baseline)"
    )
    args = parser.parse_args(argv)
    runs = {}
    ways = (("resumed", 8),) if args.resumed_only else (("resumed", 8), ("not_resumed", 0))
    with tempfile.TemporaryDirectory() as tmp:
        for name, resumes in ways:
            with fresh_database(args.database, Path(tmp), migrate=True) as url:
                runs[name] = run_loop(
                    run_batch(
                        url, args.episodes, args.updates, args.interval, args.latency, resumes, args.workers
                    )
                )
                print(name, json.dumps(runs[name]), flush=True)
    result = {
        "bench": "weight_update",
        "database": args.database,
        "episodes": args.episodes,
        "updates": args.updates,
        "workers": args.workers,
        "goal": GOAL,
        **runs,
        "episodes_lost_without_resumes": runs.get("not_resumed", {}).get("episodes_lost"),
        "episodes_lost_with_resumes": runs["resumed"]["episodes_lost"],
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
