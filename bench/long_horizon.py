"""The service loop's CPU per turn as an episode grows long: turns 8, 32 and 128 of 64k-token contexts.

One episode runs through the service's own loop (EpisodeRunner, ChatTokenizer, the SGLang client
over its socket transport) against the simulated SGLang worker (its own thread) whose policy calls
a tool on every turn; the environment answers each call with a short result, and its system prompt
is long enough that the context holds about 64k tokens from the first turn to the last. CPU is
the event loop's thread's own (time.thread_time), from one generate call to the next: the turn's
request building, its answer's parsing, the env step and the token accounting, none of the
simulated worker's. The figure per turn is the median over a window of turns starting there.

Run from the repo root:
    .venv/bin/python bench/long_horizon.py [--context 65536] [--repeats 3]
The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402

from service.engine.client import Generation, SGLangClient  # noqa: E402
from service.engine.transport import SocketTransport  # noqa: E402
from service.envs.base import Action, Reset, Step  # noqa: E402
from service.loop.runner import EpisodeRunner  # noqa: E402
from service.loop.toolcalls import parse_qwen25  # noqa: E402
from service.records import EpisodeRequest, EpisodeSpec  # noqa: E402
from service.sim.worker import SimConfig, SimWorker, create_sim_app, serve_in_thread  # noqa: E402
from tests.support.tokenizer import chat_tokenizer  # noqa: E402

TURNS = (8, 32, 128)
WINDOW = 8  # turns measured from each of TURNS
GOAL = "service CPU per turn at turn 128 <= 1.3x at turn 8 (64k-token contexts)"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Looks a record up.",
            "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]},
        },
    }
]
CALL = '<tool_call>\n{"name": "lookup", "arguments": {"key": "order 42"}}\n</tool_call>'


class LongEnv:
    """An environment whose every lookup answers a short record and never ends the episode."""

    tools = TOOLS

    def __init__(self, system_prompt: str) -> None:
        self.system_prompt = system_prompt

    async def reset(self, task_index: int) -> Reset:
        return Reset("Look the order up, again and again.")

    async def step(self, action: Action) -> Step:
        return Step(f"record {action.kwargs.get('key')}: shipped, 2 items, paid by card", 0.0, False)

    async def close(self) -> None:
        pass


class Opener:
    def __init__(self, system_prompt: str) -> None:
        self.system_prompt = system_prompt

    async def open(self, env_name: str, split: str, episode_key: str) -> LongEnv:
        return LongEnv(self.system_prompt)


class Timed:
    """The engine, with the loop thread's CPU time noted at every generate call."""

    def __init__(self, engine: SGLangClient) -> None:
        self.engine = engine
        self.marks: list[float] = []

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: dict[str, Any],
        rid: str,
        *,
        input_ids_json: str | None = None,
    ) -> Generation:
        self.marks.append(time.thread_time())
        return await self.engine.generate(input_ids, sampling_params, rid, input_ids_json=input_ids_json)

    async def abort(self, rid: str) -> None:
        await self.engine.abort(rid)


def system_prompt_of(tokens: int) -> str:
    """A system prompt of about `tokens` tokens of the test tokenizer."""
    chat = chat_tokenizer()
    sentence = "The agent must verify the customer's identity before any change to an order. "
    per = len(chat.encode(sentence))
    return sentence * (tokens // per)


async def run_episode(context: int, turns: int) -> list[float]:
    """CPU seconds of each turn of one episode (between consecutive generate calls)."""
    # The prompt holds all but what the turns add (about 60 tokens each).
    system_prompt = system_prompt_of(context - 60 * turns)
    config = SimConfig(latency_seconds=0.0, context_length=context * 2, policy=lambda text, key: CALL)
    sim = SimWorker(config)
    with serve_in_thread(create_sim_app(config, worker=sim)) as url:
        transport = SocketTransport()
        async with httpx.AsyncClient() as http:
            client = SGLangClient(
                http,
                url,
                max_inflight=4,
                retries=0,
                backoff_seconds=0.1,
                timeout_seconds=120.0,
                transport=transport,
            )
            timed = Timed(client)
            runner = EpisodeRunner(timed, Opener(system_prompt), chat_tokenizer(), parse_qwen25)  # type: ignore[arg-type]
            request = EpisodeRequest("long", "train", 0, {"max_new_tokens": 64}, max_turns=turns)
            result = await runner.run(EpisodeSpec("long", 0, request))
            await transport.aclose()
    assert result.num_turns == turns, (result.status, result.error)
    assert result.tokens is not None
    print(
        f"context at the end: {len(result.tokens.prompt_ids) + len(result.tokens.response_ids)} tokens",
        flush=True,
    )
    return [later - earlier for earlier, later in zip(timed.marks, timed.marks[1:], strict=False)]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--context", type=int, default=65536, help="tokens of context at the last turn")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    turns = max(TURNS) + WINDOW + 1
    per_turn: dict[int, list[float]] = {turn: [] for turn in TURNS}
    for _ in range(args.repeats):
        seconds = asyncio.run(run_episode(args.context, turns))
        for turn in TURNS:
            per_turn[turn] += seconds[turn : turn + WINDOW]
    figures = {f"turn_{turn}_cpu_ms": round(statistics.median(per_turn[turn]) * 1e3, 3) for turn in TURNS}
    result = {
        "bench": "long_horizon",
        "path": "loop",
        "context_tokens": args.context,
        "goal": GOAL,
        **figures,
        "turn_128_over_turn_8": round(figures["turn_128_cpu_ms"] / figures["turn_8_cpu_ms"], 3),
        "turn_32_over_turn_8": round(figures["turn_32_cpu_ms"] / figures["turn_8_cpu_ms"], 3),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
