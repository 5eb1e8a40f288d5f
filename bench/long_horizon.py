"""The service's CPU per turn as an episode grows long: turns 8, 32 and 128 of 64k-token contexts,
on the service's own loop (`--path loop`) or for an external agent (`--path external`).

The loop: one episode runs through the service's own loop (EpisodeRunner, ChatTokenizer, the SGLang client
over its socket transport) against the simulated SGLang worker (its own thread) whose policy calls
a tool on every turn; the environment answers each call with a short result, and its system prompt
is long enough that the context holds about 64k tokens from the first turn to the last. CPU is
the event loop's thread's own (time.thread_time), from one generate call to the next: the turn's
request building, its answer's parsing, the env step and the token accounting, none of the
simulated worker's. The figure per turn is the median over a window of turns starting there.

An external agent: `python -m service serve` runs in its own process on `--database`; one agent
(this process) plays an `external` episode over chat completions, sending its whole conversation
every call as the `openai` package does (a long system prompt, then each answer and a short user
message), against the simulated worker (this process's thread). CPU is the service process's own
(the on-CPU time of its threads, /proc's schedstat, in nanoseconds), from before a call is sent to
after its answer is read: everything the service does for that call, none of the agent's or the
engine's. `--profile FILE` runs the service under pyinstrument (which must be importable) and
writes its profile there as text.

Run from the repo root:
    .venv/bin/python bench/long_horizon.py [--context 65536] [--repeats 3]
        [--path loop|external] [--database sqlite|postgres] [--profile FILE]
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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402
import orjson  # noqa: E402

from bench.common import fresh_database, serve_process  # noqa: E402
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


# `python -m service` under pyinstrument (its event loop's thread, sampled every millisecond), the
# profile written as text on SIGTERM (uvicorn raises it again once it stopped).
PROFILED = """
import os, runpy, signal, sys
from pyinstrument import Profiler
profiler = Profiler(interval=0.001)
def written(*_):
    profiler.stop()
    with open({stats!r}, "w") as out:
        out.write(profiler.output_text(unicode=True, show_all=False))
    os._exit(0)
signal.signal(signal.SIGTERM, written)
sys.argv = ["service", *sys.argv[1:]]
profiler.start()
runpy.run_module("service", run_name="__main__")
"""
ANSWER = "Order 42 has shipped: 2 items, paid by card. Anything else about it?"


def on_cpu_seconds(pid: int) -> float:
    """The on-CPU time of a process's threads (Linux /proc schedstat, nanoseconds)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, IndexError, ValueError):  # a thread that just ended
            pass
    return total / 1e9


async def play_external(url: str, pid: int, system_prompt: str, turns: int) -> list[float]:
    """The service's CPU seconds for each call of one external episode of `turns` calls."""
    async with httpx.AsyncClient(timeout=300) as http:
        opened = await http.post(
            f"{url}/episodes",
            json={"env": "external", "task_indices": [0], "samples_per_task": 1, "max_turns": turns},
        )
        opened.raise_for_status()
        (agent,) = opened.json()["agents"]
        headers = {"Authorization": f"Bearer {agent['api_key']}", "Content-Type": "application/json"}
        history: list[Any] = [
            {"role": "system", "content": system_prompt},
            {"role": "user", "content": "Look the order up, again and again."},
        ]
        seconds = []
        for call in range(turns):
            body = orjson.dumps({"model": "policy", "messages": history, "max_tokens": 64})
            before = on_cpu_seconds(pid)
            answer = await http.post(f"{agent['base_url']}/chat/completions", content=body, headers=headers)
            seconds.append(on_cpu_seconds(pid) - before)
            answer.raise_for_status()
            history.append(answer.json()["choices"][0]["message"])
            history.append({"role": "user", "content": f"record order 42: shipped, 2 items ({call})"})
        finished = await http.post(f"{agent['base_url']}/finish", json={"reward": 1.0}, headers=headers)
        finished.raise_for_status()
        episode = (await http.get(f"{url}/episodes/{agent['episode_id']}")).json()
    assert episode["segments"] == 1 and episode["num_turns"] == turns, episode["segments"]
    context = len(episode["prompt_ids"]) + len(episode["response_ids"])
    print(f"context at the end: {context} tokens", flush=True)
    return seconds


def run_external(context: int, turns: int, database: str, profile: Path | None) -> list[float]:
    system_prompt = system_prompt_of(context - 60 * turns)
    config = SimConfig(latency_seconds=0.0, context_length=context * 2, policy=lambda text, key: ANSWER)
    with (
        tempfile.TemporaryDirectory() as tmp,
        serve_in_thread(create_sim_app(config, worker=SimWorker(config))) as sim_url,
        fresh_database(database, Path(tmp), migrate=True) as database_url,
    ):
        launcher = ("-m", "service") if profile is None else ("-c", PROFILED.format(stats=str(profile)))
        with serve_process(database_url, sim_url, Path(tmp), launcher=launcher) as served:
            return asyncio.run(play_external(served.url, served.pid, system_prompt, turns))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--context", type=int, default=65536, help="tokens of context at the last turn")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--path", choices=["loop", "external"], default="loop")
    parser.add_argument("--database", choices=["sqlite", "postgres"], default="sqlite", help="external only")
    parser.add_argument("--profile", type=Path, default=None, help="external only: pyinstrument text profile")
    args = parser.parse_args(argv)
    turns = max(TURNS) + WINDOW + 1
    per_turn: dict[int, list[float]] = {turn: [] for turn in TURNS}
    for _ in range(args.repeats):
        if args.path == "loop":
            seconds = asyncio.run(run_episode(args.context, turns))
        else:
            seconds = run_external(args.context, turns, args.database, args.profile)
        for turn in TURNS:
            per_turn[turn] += seconds[turn : turn + WINDOW]
    figures = {f"turn_{turn}_cpu_ms": round(statistics.median(per_turn[turn]) * 1e3, 3) for turn in TURNS}
    result = {
        "bench": "long_horizon",
        "path": args.path,
        **({"database": args.database} if args.path == "external" else {}),
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
