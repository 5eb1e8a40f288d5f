"""External agents' test helpers: a weather agent's tools and the simulated policy that plays it,
opening external episodes and finishing them."""

from __future__ import annotations

import json
from typing import Any

import httpx

from service.agents.conversation import Answer
from service.agents.deps import StreamEvents
from service.agents.streaming import AnswerStream, TextDeltas

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
CALL = (
    "<think>The user wants the weather.</think>\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)
ANSWER = "It is sunny in Paris."
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
QUESTION = {"role": "user", "content": "What is the weather in Paris?"}


def weather_policy(prompt: str, key: str) -> str:
    """Calls the tool until a tool response is in the prompt, then answers."""
    return ANSWER if "<tool_response>" in prompt.rsplit("<|im_start|>user", 1)[-1] else CALL


async def open_episodes(http: httpx.AsyncClient, samples: int = 1, **extra: Any) -> list[dict[str, Any]]:
    body = {
        "env": "external",
        "task_split": "weather",
        "task_indices": [7],
        "samples_per_task": samples,
        **extra,
    }
    response = await http.post("/episodes", json=body)
    assert response.status_code == 202, response.text
    agents: list[dict[str, Any]] = response.json()["agents"]
    assert [agent["episode_id"] for agent in agents] == response.json()["episode_ids"]
    return agents


async def finish(http: httpx.AsyncClient, agent: dict[str, Any], **body: Any) -> httpx.Response:
    return await http.post(
        f"/v1/episodes/{agent['episode_id']}/finish",
        json=body,
        headers={"Authorization": f"Bearer {agent['api_key']}"},
    )


def replayed(
    events: StreamEvents, answer: Answer, *, prompt_tokens: int = 0
) -> list[tuple[str, dict[str, Any]]]:
    """A recorded answer as a protocol streams it (its text as one piece): (event name, data) of
    each server-sent event (the name is the data's `type` where the frame has no `event:` line)."""
    deltas = TextDeltas(lambda ids: "", [])
    frames = [*events.start(AnswerStream(prompt_tokens=prompt_tokens))]
    frames += [frame for kind, text in deltas.rest(answer) for frame in events.delta(kind, text)]
    frames += events.end(answer)
    parsed = []
    for frame in b"".join(frames).decode().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in frame.splitlines())
        if lines and lines.get("data") != "[DONE]":
            data = json.loads(lines["data"])
            parsed.append((lines.get("event", data.get("type", "")), data))
    return parsed
