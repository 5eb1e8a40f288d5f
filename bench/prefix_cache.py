"""The engines' prefix-cache hit rate under the service's placement of generate calls.

A batch of G groups x S multi-turn episodes (builtin/shop) runs through the service (in this
process) against W simulated SGLang workers (each in its own thread, each with its own prefix
cache, reporting meta_info.cached_tokens as SGLang does), listed in SGLANG_WORKER_URLS. The same
batch runs twice in one run: with sticky placement (ENGINE_PLACEMENT=sticky: every call of an
episode on one worker, a group's episodes on one worker while its load allows) and with
round-robin placement (each call to the next worker). Measured: the share of prompt tokens the
workers served from their caches (from the workers' answers, and as the service's /metrics
reports it), calls per worker, and the batch's wall time.

Run from the repo root:
    .venv/bin/python bench/prefix_cache.py [--groups 64] [--samples 8] [--workers 4]
The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from contextlib import ExitStack
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

GOAL = ">= 90% of prompt tokens served from the prefix cache with sticky placement"
HIT_RATE_METRIC = re.compile(rb"^rollout_prefix_cache_hit_rate (\S+)$", re.MULTILINE)


def served(sims: list[SimWorker]) -> dict[str, Any]:
    """Prompt and cached tokens over every call the workers answered, and calls per worker."""
    prompt = cached = 0
    for sim in sims:
        for request in sim.requests:
            if request.response_body is not None:
                meta = json.loads(request.response_body)["meta_info"]
                prompt += meta.get("prompt_tokens", 0)
                cached += meta.get("cached_tokens", 0)
    return {
        "hit_rate": round(cached / prompt, 4) if prompt else 0.0,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "prefilled_tokens": prompt - cached,  # what the workers computed again
        "calls_per_worker": [len(sim.requests) for sim in sims],
    }


async def run_batch(
    database_url: str, groups: int, samples: int, workers: int, placement: str
) -> dict[str, Any]:
    # Episodes that fail on a malformed call would end early: every one runs its course here.
    config = SimConfig(latency_seconds=0.02, malformed_call_rate=0.0)
    sims = [SimWorker(config) for _ in range(workers)]
    with ExitStack() as stack:
        urls = [stack.enter_context(serve_in_thread(create_sim_app(config, worker=sim))) for sim in sims]
        settings = Settings(
            database_url=database_url,
            sglang_url=urls[0],
            sglang_worker_urls=",".join(urls),
            engine_placement=placement,
            api_keys="",
            log_level="WARNING",
        )  # type: ignore[call-arg]
        async with (
            serve_app(create_app(settings)) as url,
            httpx.AsyncClient(base_url=url, timeout=600) as http,
        ):
            body = {
                "batch_id": "cache",
                "env": "builtin/shop",
                "task_split": "train",
                "task_indices": list(range(groups)),
                "samples_per_task": samples,
                "sampling_params": {"temperature": 1.0, "max_new_tokens": 256},
                "max_turns": 30,
            }
            started = time.monotonic()
            assert (await http.post("/episodes", json=body)).status_code == 202
            batch = (await http.get("/batches/cache", params={"wait": 1800})).json()
            seconds = time.monotonic() - started
            metrics = (await http.get("/metrics")).content
    reported = HIT_RATE_METRIC.search(metrics)
    return {
        "complete": batch["complete"],
        "counts": {status: count for status, count in batch["counts"].items() if count},
        **served(sims),
        "metrics_hit_rate": round(float(reported.group(1)), 4) if reported else None,
        "seconds": round(seconds, 2),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--database", choices=["sqlite", "postgres"], default="sqlite")
    args = parser.parse_args(argv)
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for placement in ("sticky", "round_robin"):
            with fresh_database(args.database, Path(tmp), migrate=True) as url:
                runs[placement] = run_loop(run_batch(url, args.groups, args.samples, args.workers, placement))
                print(placement, json.dumps(runs[placement]), flush=True)
    result = {
        "bench": "prefix_cache",
        "database": args.database,
        "groups": args.groups,
        "samples": args.samples,
        "workers": args.workers,
        "goal": GOAL,
        **runs,
        "hit_rate_sticky": runs["sticky"]["hit_rate"],
        "hit_rate_round_robin": runs["round_robin"]["hit_rate"],
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
