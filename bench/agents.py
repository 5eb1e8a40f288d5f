"""External agents: thousands of agents in flight through their episodes' endpoints, speaking chat
completions, Anthropic's Messages or OpenAI's Responses (`--protocol`).

`python -m service serve` and the simulated SGLang worker each run in their own process. One batch
of N `external` episodes is opened; N agents (raw httpx sending what the `openai` package sends,
sharing one connection pool, in this process) each make `--calls` calls, extending their
conversation every time, then finish. Meanwhile /health is probed. Measured: calls/s, the service's
CPU per call against a bare client's CPU per /generate call to the same worker (the HTTP call we
exist to make), the overhead a call adds to the engine's latency, errors, and what was stored
(every episode complete, one segment, `--calls` calls).

Run from the repo root:
    .venv/bin/python bench/agents.py [--agents 2000] [--calls 3] [--latency 0.5] [--database sqlite]
        [--protocol chat|messages|responses]
The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import aiohttp  # noqa: E402
import httpx  # noqa: E402
import orjson  # noqa: E402

from bench.common import (  # noqa: E402
    HealthProbe,
    cpu_seconds_of,
    fresh_database,
    percentiles_ms,
    serve_process,
    sim_worker,
)

SYSTEM = {"role": "system", "content": "You are a helpful assistant of an online shop."}
GOAL = (
    "thousands of agents in flight, every call recorded, /health answering, CPU per call near the HTTP call's"
)


def chat_request(history: list[Any], call: int) -> tuple[str, dict[str, Any]]:
    return "/chat/completions", {"model": "policy", "messages": history, "max_tokens": 64}


def chat_reply(answer: dict[str, Any]) -> list[Any]:
    return [answer["choices"][0]["message"]]


def messages_request(history: list[Any], call: int) -> tuple[str, dict[str, Any]]:
    body = {"model": "policy", "system": SYSTEM["content"], "messages": history[1:], "max_tokens": 64}
    return "/messages", body


def messages_reply(answer: dict[str, Any]) -> list[Any]:
    return [{"role": "assistant", "content": answer["content"]}]


def responses_request(history: list[Any], call: int) -> tuple[str, dict[str, Any]]:
    body = {
        "model": "policy",
        "instructions": SYSTEM["content"],
        "input": history[1:],
        "max_output_tokens": 64,
    }
    return "/responses", body


def responses_reply(answer: dict[str, Any]) -> list[Any]:
    return list(answer["output"])


# What each protocol's client sends and appends to its history (the history starts with SYSTEM).
PROTOCOLS = {
    "chat": (chat_request, chat_reply),
    "messages": (messages_request, messages_reply),
    "responses": (responses_request, responses_reply),
}


async def agent(
    session: aiohttp.ClientSession,
    endpoint: dict[str, Any],
    calls: int,
    latencies: list[float],
    protocol: str = "chat",
) -> str:
    """One agent: what the `openai` (or `anthropic`) package sends and reads (tests/test_agents*.py
    drive the packages themselves), on a plain aiohttp session, so that the bench's own CPU does
    not limit the service's."""
    request, reply = PROTOCOLS[protocol]
    headers = {"Authorization": f"Bearer {endpoint['api_key']}", "Content-Type": "application/json"}
    history: list[Any] = [SYSTEM, {"role": "user", "content": "Where is my order #W1001?"}]
    try:
        for call in range(calls):
            started = time.perf_counter()
            path, body = request(history, call)
            async with session.post(
                f"{endpoint['base_url']}{path}", data=orjson.dumps(body), headers=headers
            ) as answer:
                answer.raise_for_status()
                content = await answer.read()
            latencies.append(time.perf_counter() - started)
            history += reply(orjson.loads(content))
            history.append({"role": "user", "content": f"Thanks. And then ({call})?"})
        finish = orjson.dumps({"reward": 1.0})
        async with session.post(f"{endpoint['base_url']}/finish", data=finish, headers=headers) as finished:
            finished.raise_for_status()
        return "ok"
    except aiohttp.ClientError as error:
        return type(error).__name__


async def bare_calls(sim_url: str, count: int) -> float:
    """CPU seconds per /generate call of a plain aiohttp session, `count` calls at once."""
    body = {
        "input_ids": list(range(1, 400)),
        "sampling_params": {"max_new_tokens": 64},
        "return_logprob": True,
    }
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=count)) as session:

        async def call(number: int) -> None:
            data = orjson.dumps({**body, "rid": f"bare-{number}"})
            async with session.post(f"{sim_url}/generate", data=data, headers=headers) as response:
                await response.read()

        started = time.process_time()
        await asyncio.gather(*(call(number) for number in range(count)))
        return (time.process_time() - started) / count


async def drive(url: str, service_pid: int, sim_url: str, args: argparse.Namespace) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=args.agents, max_keepalive_connections=args.agents)
    async with httpx.AsyncClient(timeout=300, limits=limits) as http:
        submitted = await http.post(
            f"{url}/episodes",
            json={"env": "external", "task_indices": list(range(args.agents)), "samples_per_task": 1},
        )
        submitted.raise_for_status()
        endpoints = submitted.json()["agents"]
        health = HealthProbe(url)  # on its own thread: this loop's own lag does not count
        health.start()
        latencies: list[float] = []
        cpu_before, started = cpu_seconds_of(service_pid), time.perf_counter()
        connector = aiohttp.TCPConnector(limit=args.agents)
        async with aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=600)
        ) as session:
            outcomes = await asyncio.gather(
                *(agent(session, endpoint, args.calls, latencies, args.protocol) for endpoint in endpoints)
            )
        wall, cpu = time.perf_counter() - started, cpu_seconds_of(service_pid) - cpu_before
        health_figures = health.stats()
        batch = (await http.get(f"{url}/batches/{submitted.json()['batch_id']}")).json()
        stored = Counter((episode["status"], episode["num_turns"]) for episode in batch["episodes"])
        detail = (await http.get(f"{url}/episodes/{endpoints[0]['episode_id']}")).json()
    calls = len(latencies)
    bare = await bare_calls(sim_url, min(args.agents, 1000))
    cpu_per_call = cpu / max(calls, 1)
    overhead = [latency - args.latency for latency in latencies]
    return {
        "calls": calls,
        "wall_s": round(wall, 2),
        "calls_per_s": round(calls / wall, 1),
        "outcomes": dict(Counter(outcomes)),
        "stored": {f"{status}, {turns} calls": count for (status, turns), count in stored.items()},
        "complete": batch["complete"],
        "segments_of_first": detail["segments"],
        "service_cpu_ms_per_call": round(1000 * cpu_per_call, 3),
        "bare_client_cpu_ms_per_call": round(1000 * bare, 3),
        "cpu_ratio_to_bare_client": round(cpu_per_call / bare, 2),
        "call_overhead_ms": percentiles_ms(overhead),
        **health_figures,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--agents", type=int, default=2000)
    parser.add_argument("--calls", type=int, default=3, help="chat completions per agent")
    parser.add_argument("--latency", type=float, default=0.5, help="the simulated engine's seconds per call")
    parser.add_argument("--database", choices=["sqlite", "postgres"], default="sqlite")
    parser.add_argument(
        "--protocol", choices=sorted(PROTOCOLS), default="chat",
        help="chat completions, Anthropic's messages or OpenAI's responses",
    )  # fmt: skip
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp, sim_worker(args.latency, Path(tmp)) as (sim_url, _):
        with fresh_database(args.database, Path(tmp), migrate=True) as database_url:
            bound = str(max(10_000, args.agents))
            with serve_process(database_url, sim_url, Path(tmp), MAX_EPISODES_PER_REQUEST=bound) as served:
                figures = asyncio.run(drive(served.url, served.pid, sim_url, args))
            errors = served.error_log_lines()
    result = {
        "bench": "agents",
        "database": args.database,
        "protocol": args.protocol,
        "agents": args.agents,
        "calls_per_agent": args.calls,
        "latency_s": args.latency,
        "goal": GOAL,
        **figures,
        "service_error_log_lines": errors,
    }
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
