"""bench/verifiers_envs.py's light agent: agent-driven envs (`wire/vf_arithmetic`, `wire/vf_files`)
whose driver sends the episode's endpoint the requests verifiers' harnesses send for
tests/verifiers_tasksets' tasks (a stream of chat completions with usage; the null harness's bare
user turn; the bash harness's system prompt and tools, then its tool result), without verifiers'
harness program per rollout: a thousand of them fit in two env worker processes, where a thousand
harness programs do not. The service's side (hand-over, calls, finish) is the same as for verifiers'
own rollouts (`ENV_PLUGINS=vf_wire:env_specs`, with `vf_plugins:env_specs` for the tasks)."""

from __future__ import annotations

import asyncio
import functools
import json
from typing import Any

import httpx

from service.envs.api import DriveOutcome, DriveRequest, EnvSpec
from service.envs.verifiers_envs import VerifiersEnv, not_stepped, rollout_loop, task_of

# What verifiers' bash harness sends beside the task (recorded from its requests to the endpoint).
BASH_SYSTEM = (
    "You are a coding agent. You have access to a bash tool for running shell commands. You also "
    "have an edit tool for single-occurrence string replacement in a file."
)
BASH_TOOLS = [
    {"type": "function", "function": {
        "name": "bash", "description": "Run a bash command and return its combined stdout and stderr.",
        "parameters": {"type": "object", "properties": {
            "command": {"type": "string", "description": "The bash command to run."}},
            "required": ["command"]}}},
    {"type": "function", "function": {
        "name": "edit",
        "description": "Replace a unique string in a file. old_str must appear exactly once in the file.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string", "description": "File path (relative to cwd or absolute)."},
            "old_str": {"type": "string", "description": "Exact string to find (must appear exactly once)."},
            "new_str": {"type": "string", "description": "Replacement string."}},
            "required": ["path", "old_str", "new_str"]}}},
]  # fmt: skip
TASKSETS = {
    "wire/vf_arithmetic": (VerifiersEnv("vf_arithmetic", split_configs={"test": {"offset": 100}}), False),
    "wire/vf_files": (VerifiersEnv("vf_files", harness="bash"), True),
}
_HTTP: dict[int, httpx.AsyncClient] = {}  # one client per rollout loop
RETRIES = 2  # the openai SDK's default max_retries


def env_specs() -> list[EnvSpec]:
    return [
        EnvSpec(
            name=name,
            splits={"train": 20, "test": 20} if not tools else {"train": 4},
            description="verifiers' harness requests for tests/verifiers_tasksets' tasks (bench only)",
            factory=functools.partial(not_stepped, name),
            train_split="train",
            driver=functools.partial(play, name),
        )
        for name, (_, tools) in TASKSETS.items()
    ]


def play(name: str, request: DriveRequest) -> DriveOutcome:
    return asyncio.run_coroutine_threadsafe(_play(name, request), rollout_loop()).result()


async def _play(name: str, request: DriveRequest) -> DriveOutcome:
    env, tools = TASKSETS[name]
    task = task_of(env, request.task_split, request.task_index)
    http = _HTTP.get(id(asyncio.get_running_loop()))
    if http is None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=2000)
        http = _HTTP[id(asyncio.get_running_loop())] = httpx.AsyncClient(timeout=600, limits=limits)
    messages: list[dict[str, Any]] = [{"role": "user", "content": task.data.prompt}]
    if tools:
        messages.insert(0, {"role": "system", "content": BASH_SYSTEM})
    for _ in range(request.max_turns):
        body = {
            "model": "policy",
            "messages": messages,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if tools:
            body["tools"] = BASH_TOOLS
        message = await _streamed(http, request, body)
        messages.append(message)
        if not message.get("tool_calls"):
            break
        messages += [
            {"role": "tool", "tool_call_id": call["id"], "content": ""} for call in message["tool_calls"]
        ]
    return DriveOutcome(1.0, {"wire": {"calls": sum(m["role"] == "assistant" for m in messages)}})


async def _streamed(http: httpx.AsyncClient, request: DriveRequest, body: dict[str, Any]) -> dict[str, Any]:
    """One streamed chat completion, read to its end: the assistant message it streamed. A pooled
    connection the server closed meanwhile (its keep-alive ran out) is tried again, as the openai
    SDK's retries do."""
    for _ in range(RETRIES):
        try:
            return await _stream_once(http, request, body)
        except (httpx.ReadError, httpx.RemoteProtocolError):
            continue
    return await _stream_once(http, request, body)


async def _stream_once(
    http: httpx.AsyncClient, request: DriveRequest, body: dict[str, Any]
) -> dict[str, Any]:
    content, calls = "", []
    headers = {"Authorization": f"Bearer {request.api_key}"}
    async with http.stream(
        "POST", f"{request.base_url}/chat/completions", json=body, headers=headers
    ) as answer:
        answer.raise_for_status()
        async for line in answer.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:]).get("choices", ()):
                delta = choice.get("delta", {})
                content += delta.get("content") or ""
                calls += delta.get("tool_calls") or []
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [{k: v for k, v in call.items() if k != "index"} for call in calls]
    return message
