"""The HTTP floor of an agent's call: what a bare server costs to take a streamed chat completion and
stream a short answer back, with nothing behind it.

A model call that reaches the service through an episode's endpoint (an external agent, an
agent-driven env's driver) is an HTTP request the service's own loop never serves: this is that
request's share of the service's CPU, measured on the smallest server that speaks it (uvicorn, as
`serve` runs it, with a raw ASGI app that parses the request's JSON and streams the five server-sent
events the service writes for a short answer: the role, the text, the finish reason, the usage,
`[DONE]`). bench/verifiers_envs.py runs it in the same run as its phases, so a driven call's CPU
can be read against it; run alone, it prints its own figures.

Run from the repo root:
    .venv/bin/python bench/http_floor.py [--episodes 1000]
The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402
import orjson  # noqa: E402
from starlette.types import Receive, Scope, Send  # noqa: E402

from bench.common import cpu_seconds_of, launch, stop, wait_healthy  # noqa: E402
from service.agents.chat_completions import CompletionChunks  # noqa: E402
from service.agents.conversation import Answer  # noqa: E402
from service.agents.streaming import AnswerStream  # noqa: E402
from tests.support.ports import free_port  # noqa: E402

GOAL = "the server's CPU per streamed chat completion of an HTTP endpoint with nothing behind it"
WARM_EPISODES = 50
USER_TURN = {"role": "user", "content": "What is 37 times 12? Answer with the number only."}
ANSWER = "The answer is 444."


def _events() -> list[bytes]:
    """The events the service streams for a short text answer (its own CompletionChunks)."""
    chunks = CompletionChunks("policy", include_usage=True)
    answer = Answer(content=ANSWER, reasoning=None, prompt_tokens=40, completion_tokens=8)
    return [*chunks.start(AnswerStream()), *chunks.delta("content", ANSWER), *chunks.end(answer)]


EVENTS = _events()
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    """The floor's server: `GET /health`, and any POST answered as a streamed chat completion once
    its JSON body is read and parsed (a body that does not parse is a 400)."""
    if scope["type"] != "http":
        return
    if scope["method"] != "POST":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})
        return
    body, more = b"", True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    try:
        orjson.loads(body)
    except orjson.JSONDecodeError:
        await send({"type": "http.response.start", "status": 400, "headers": []})
        await send({"type": "http.response.body", "body": b"not JSON"})
        return
    await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
    for event in EVENTS:
        await send({"type": "http.response.body", "body": event, "more_body": True})
    await send({"type": "http.response.body", "body": b""})


def conversations(
    episodes: int, system: str | None, tools: list[dict[str, Any]] | None
) -> list[list[dict[str, Any]]]:
    """Each episode's requests, as bench/verifiers_envs.py's light agent sends them: half one call
    with a bare user turn, half two calls with a system prompt and tools (the second after a tool
    result)."""
    single = {
        "model": "policy",
        "messages": [USER_TURN],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    first_messages = [{"role": "system", "content": system or "You are a coding agent."}, USER_TURN]
    first = {**single, "messages": first_messages, "tools": tools or []}
    call = {
        "id": "call_0",
        "type": "function",
        "function": {"name": "bash", "arguments": '{"command": "ls"}'},
    }
    answered = [
        *first_messages,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": ""},
    ]
    second = {**first, "messages": answered}
    half = episodes // 2
    return [[single]] * half + [[first, second]] * (episodes - half)


async def _play(http: httpx.AsyncClient, url: str, bodies: list[dict[str, Any]]) -> int:
    """The episode's requests in turn; how many of their answers streamed to their end."""
    ended = 0
    for body in bodies:
        async with http.stream("POST", url, json=body, headers={"Authorization": "Bearer floor"}) as answer:
            answer.raise_for_status()
            streamed = b"".join([chunk async for chunk in answer.aiter_bytes()])
        ended += streamed.endswith(EVENTS[-1])
    return ended


async def _requests(url: str, pid: int, episodes: list[list[dict[str, Any]]]) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=len(episodes))
    endpoint = f"{url}/v1/episodes/floor/chat/completions"
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        await asyncio.gather(*(_play(http, endpoint, bodies) for bodies in episodes[:WARM_EPISODES]))
        before, start = cpu_seconds_of(pid), time.perf_counter()
        ended = await asyncio.gather(*(_play(http, endpoint, bodies) for bodies in episodes))
        cpu, seconds = cpu_seconds_of(pid) - before, time.perf_counter() - start
    requests = sum(len(bodies) for bodies in episodes)
    return {
        "episodes": len(episodes),
        "requests": requests,
        "answers_streamed_to_end": sum(ended),
        "seconds": round(seconds, 2),
        "server_cpu_ms_per_request": round(cpu / requests * 1000, 3),
    }


def measure(
    episodes: int, *, system: str | None = None, tools: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """The floor at `episodes` in flight: uvicorn serving `app` in its own process, as `serve` runs
    the service (uvloop and httptools where installed, no websockets)."""
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "floor.log"
        arguments = ["-m", "uvicorn", "bench.http_floor:app", "--port", str(port), "--ws", "none",
                     "--log-level", "warning", "--no-access-log", "--timeout-keep-alive", "75"]  # fmt: skip
        server = launch(arguments, {**os.environ, "PYTHONPATH": str(REPO)}, log)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url, server, log)
            return asyncio.run(_requests(url, server.pid, conversations(episodes, system, tools)))
        finally:
            stop(server)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser()
    parser.add_argument("--episodes", type=int, default=1000, help="in flight")
    args = parser.parse_args(argv)
    result = {"goal": GOAL, **measure(args.episodes)}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
