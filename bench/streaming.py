"""Streamed time to first token: an external agent's streamed answer against the engine's own.

`python -m service serve` and the simulated SGLang worker (pacing its tokens, streaming each one)
each run in their own process, on loopback. Per protocol (chat completions, Anthropic's Messages,
OpenAI's Responses), calls alternate between the engine itself (a streaming /generate of the same
conversation's ids: the time to its first frame with a token) and an agent's streamed call through
its episode (the time to the first text delta), one at a time; an agent makes `--turns` calls,
its conversation growing.
Measured: both times' percentiles and the difference of their medians (goal: <= 5 ms).

Run from the repo root:
    .venv/bin/python bench/streaming.py [--calls 40] [--latency 0.05] [--per-token 0.005]
        [--turns 8] [--database sqlite]
The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import aiohttp  # noqa: E402
import orjson  # noqa: E402

from bench.common import fresh_database, percentiles_ms, serve_process, sim_worker  # noqa: E402
from tests.support.tokenizer import load_test_tokenizer  # noqa: E402

GOAL_MS = 5.0
ANSWER = "It is sunny and warm today, with a light breeze from the west. " * 3


def policy(prompt: str, key: str) -> str:
    """The simulated worker's answer to every call: plain text, streamed token by token."""
    return ANSWER


def conversation(turn: int) -> list[dict[str, Any]]:
    """An agent's messages at its `turn`-th call: each earlier answer as it was recorded."""
    messages = [{"role": "user", "content": "How is the weather today?"}]
    for earlier in range(turn):
        messages += [
            {"role": "assistant", "content": ANSWER.strip()},
            {"role": "user", "content": f"And in {earlier + 1} days?"},
        ]
    return messages


# Each protocol's path, request body at a turn, and what its first text delta holds on the wire.
PROTOCOLS: dict[str, tuple[str, Callable[[int], dict[str, Any]], bytes]] = {
    "chat": (
        "/chat/completions",
        lambda turn: {"model": "policy", "messages": conversation(turn), "stream": True},
        b'"content":"',
    ),
    "messages": (
        "/v1/messages",
        lambda turn: {"model": "policy", "max_tokens": 256, "messages": conversation(turn), "stream": True},
        b'"text_delta"',
    ),
    "responses": (
        "/responses",
        lambda turn: {"model": "policy", "input": conversation(turn), "stream": True},
        b"output_text.delta",
    ),
}


async def _first(response: aiohttp.ClientResponse, marker: bytes, started: float) -> float:
    """Seconds from `started` to the first chunk holding `marker`; reads the rest."""
    first = None
    async for chunk in response.content.iter_any():
        if first is None and marker in chunk:
            first = time.perf_counter() - started
    assert first is not None, "no text in the stream"
    return first


async def engine_first(session: aiohttp.ClientSession, sim_url: str, rid: str, input_ids: list[int]) -> float:
    body = {
        "input_ids": input_ids,
        "sampling_params": {"max_new_tokens": 64},
        "return_logprob": True,
        "rid": rid,
        "stream": True,
    }
    started = time.perf_counter()
    async with session.post(f"{sim_url}/generate", data=orjson.dumps(body)) as response:
        return await _first(response, b'"output_ids":[', started)


async def agent_first(
    session: aiohttp.ClientSession, agent: dict[str, Any], protocol: str, turn: int
) -> float:
    path, body, marker = PROTOCOLS[protocol]
    headers = {"Authorization": f"Bearer {agent['api_key']}", "Content-Type": "application/json"}
    data = orjson.dumps(body(turn))
    started = time.perf_counter()
    async with session.post(f"{agent['base_url']}{path}", data=data, headers=headers) as response:
        response.raise_for_status()
        return await _first(response, marker, started)


async def drive(url: str, sim_url: str, args: argparse.Namespace) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session:
        opened = {"env": "external", "task_split": "weather", "task_indices": [0], "samples_per_task": 1}
        agents = []
        for _ in range(len(PROTOCOLS) * (args.calls // args.turns + 2)):
            async with session.post(f"{url}/episodes", json=opened) as response:
                agents += (await response.json())["agents"]
        figures: dict[str, Any] = {}
        tokenizer = load_test_tokenizer()
        for protocol in PROTOCOLS:
            await agent_first(session, agents.pop(), protocol, 0)  # the first call loads the tokenizer
            engine, agent = [], []
            for call in range(args.calls):
                # The engine's own call carries the conversation the agent's call renders to.
                text = tokenizer.apply_chat_template(
                    conversation(call % args.turns), add_generation_prompt=True, tokenize=False
                )
                input_ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
                engine.append(await engine_first(session, sim_url, f"bench-{protocol}-{call}", input_ids))
                if call % args.turns == 0:
                    playing = agents.pop()
                agent.append(await agent_first(session, playing, protocol, call % args.turns))
            added = statistics.median(agent) - statistics.median(engine)
            figures[protocol] = {
                "engine_first_token_ms": percentiles_ms(engine),
                "streamed_first_token_ms": percentiles_ms(agent),
                "added_ms_median": round(added * 1000, 2),
                "goal_met": added * 1000 <= GOAL_MS,
            }
    return figures


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=40, help="timed calls per protocol, each side")
    parser.add_argument("--latency", type=float, default=0.05, help="the engine's seconds to its first token")
    parser.add_argument("--per-token", type=float, default=0.005, help="the engine's seconds per later token")
    parser.add_argument("--turns", type=int, default=8, help="calls per agent")
    parser.add_argument("--database", choices=["sqlite", "postgres"], default="sqlite")
    args = parser.parse_args(argv)
    options = (
        "--per-token-latency",
        str(args.per_token),
        "--stream-interval",
        "1",
        "--policy",
        "bench.streaming:policy",
    )
    with tempfile.TemporaryDirectory() as tmp, sim_worker(args.latency, Path(tmp), options) as (sim_url, _):
        with fresh_database(args.database, Path(tmp), migrate=True) as database_url:
            with serve_process(database_url, sim_url, Path(tmp)) as served:
                figures = asyncio.run(drive(served.url, sim_url, args))
    result = {
        "bench": "streaming",
        "database": args.database,
        "calls": args.calls,
        "turns_per_agent": args.turns,
        "engine_latency_s": args.latency,
        "per_token_s": args.per_token,
        "goal": f"streamed first token <= {GOAL_MS} ms above the engine's own (median)",
        **figures,
    }
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
