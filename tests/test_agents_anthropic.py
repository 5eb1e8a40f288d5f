"""External agents driven by the `anthropic` package through their episodes' Messages endpoint
(the SDK pointed at the episode's base URL): tool use, thinking blocks sent back, streaming with
Anthropic's events, max_tokens, and errors in Anthropic's shape. An agent that replays its history
gets one segment, exact against the engine's request log."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from service.agents.anthropic_messages import MessageEvents, message_body
from service.agents.conversation import Answer
from service.sim.worker import SimWorker
from tests.support.agents import ANSWER, QUESTION, SYSTEM, TOOLS, finish, open_episodes, replayed
from tests.support.contract import assert_tokens_match_calls, sim_calls
from tests.support.tokenizer import load_test_tokenizer

# The SDK is imported where it is used: at the top of the module, every pytest-xdist worker paid for
# it (seconds of CPU) while collecting, whether it ran these tests or not.
if TYPE_CHECKING:
    import anthropic

TOOL = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": TOOLS[0]["function"]["parameters"],  # type: ignore[index]
}


def claude(agent: dict[str, Any]) -> anthropic.AsyncAnthropic:
    import anthropic

    return anthropic.AsyncAnthropic(base_url=agent["base_url"], api_key=agent["api_key"], max_retries=0)


def as_history(message: anthropic.types.Message) -> dict[str, Any]:
    """The assistant's message as an agent appends it to its history: every block, thinking too."""
    return {
        "role": "assistant",
        "content": [block.model_dump(exclude_none=True) for block in message.content],
    }


async def play(agent: dict[str, Any], *, stream: bool) -> None:
    """Question, tool use (after thinking), tool result, answer: Claude's tool loop."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION["content"]}]
    request: dict[str, Any] = {
        "model": "policy",
        "max_tokens": 256,
        "system": SYSTEM["content"],
        "tools": [TOOL],
    }
    async with claude(agent) as llm:
        if stream:  # the tool_use block's input arrives as input_json_delta
            async with llm.messages.stream(messages=messages, **request) as events:  # type: ignore[arg-type]
                first = await events.get_final_message()
        else:
            first = await llm.messages.create(messages=messages, **request)  # type: ignore[arg-type]
        assert first.stop_reason == "tool_use" and first.role == "assistant"
        thinking, use = first.content
        assert thinking.type == "thinking" and thinking.thinking == "The user wants the weather."
        assert use.type == "tool_use" and use.name == "get_weather" and use.input == {"city": "Paris"}
        assert first.usage.input_tokens > 0 and first.usage.output_tokens > 0
        messages.append(as_history(first))
        result = {"type": "tool_result", "tool_use_id": use.id, "content": json.dumps({"sky": "sunny"})}
        messages.append({"role": "user", "content": [result]})
        if stream:
            async with llm.messages.stream(messages=messages, **request) as events:  # type: ignore[arg-type]
                kinds = [event.type async for event in events]
                second = await events.get_final_message()
            assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
            assert {"content_block_start", "content_block_stop", "message_delta", "text"} <= set(kinds)
        else:
            second = await llm.messages.create(messages=messages, **request)  # type: ignore[arg-type]
    assert second.stop_reason == "end_turn" and second.stop_sequence is None
    assert [block.type for block in second.content] == ["text"]
    assert second.content[0].text == ANSWER  # type: ignore[union-attr]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
async def test_a_claude_agent_that_replays_its_history_gets_one_exact_segment(
    agent_service: httpx.AsyncClient, agent_sim: tuple[SimWorker, str], stream: bool
) -> None:
    (agent,) = await open_episodes(agent_service)
    await play(agent, stream=stream)
    assert (await finish(agent_service, agent, reward=1.0)).status_code == 200
    episode = (await agent_service.get(f"/episodes/{agent['episode_id']}")).json()
    assert episode["status"] == "completed" and episode["segments"] == 1 and episode["num_turns"] == 2
    calls = sim_calls(agent_sim[0], episode["id"], 0)
    assert len(calls) == 2
    assert_tokens_match_calls(episode, calls)
    # Anthropic's system prompt and tool, rendered as the template renders the chat conversation.
    tokenizer = load_test_tokenizer()
    rendered = tokenizer.apply_chat_template(
        [SYSTEM, QUESTION], tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert episode["prompt_ids"] == tokenizer.encode(rendered, add_special_tokens=False)
    assert [turn["action"] for turn in episode["turns"]] == ["get_weather", None]
    tool_result = episode["messages"][-2]
    assert tool_result["role"] == "tool" and tool_result["name"] == "get_weather"


async def test_max_tokens_and_errors_in_anthropics_shape(
    agent_service: httpx.AsyncClient, agent_sim: tuple[SimWorker, str]
) -> None:
    import anthropic

    first, second = await open_episodes(agent_service, samples=2)
    question = [{"role": "user", "content": QUESTION["content"]}]
    async with claude(first) as llm:
        cut = await llm.messages.create(model="policy", max_tokens=3, messages=question)  # type: ignore[arg-type]
        assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3
        with pytest.raises(anthropic.UnprocessableEntityError) as refused:
            await llm.messages.create(
                model="policy",
                max_tokens=8,
                messages=question,  # type: ignore[arg-type]
                tools=[{"type": "web_search_20250305", "name": "web_search"}],  # type: ignore[list-item]
            )
        assert refused.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
        assert "server tools" in refused.value.body["error"]["message"]  # type: ignore[index]
    # Anthropic's header form of the key, on the route's own path; another episode's key is refused.
    path = f"/v1/episodes/{second['episode_id']}/messages"
    body = {"model": "policy", "max_tokens": 8, "messages": question}
    taken = await agent_service.post(path, json=body, headers={"x-api-key": second["api_key"]})
    assert taken.status_code == 200 and taken.json()["type"] == "message"
    wrong = await agent_service.post(path, json=body, headers={"x-api-key": first["api_key"]})
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
    unknown = await agent_service.post(
        "/v1/episodes/nope/v1/messages", json=body, headers={"x-api-key": first["api_key"]}
    )
    assert unknown.status_code == 404 and unknown.json()["type"] == "error"
    assert (await finish(agent_service, first, reward=0.0)).status_code == 200
    async with claude(first) as llm:
        with pytest.raises(anthropic.ConflictError) as closed:
            await llm.messages.create(model="policy", max_tokens=8, messages=question)  # type: ignore[arg-type]
    assert closed.value.body["error"]["message"].startswith("episode")  # type: ignore[index]
    episode = (await agent_service.get(f"/episodes/{first['episode_id']}")).json()
    assert episode["segments"] == 1 and episode["num_turns"] == 1  # the refused calls took no turn
    assert_tokens_match_calls(episode, sim_calls(agent_sim[0], episode["id"], 0))


async def test_a_stop_sequence_ends_the_text_and_its_replay_stays_one_segment(
    agent_service: httpx.AsyncClient, agent_sim: tuple[SimWorker, str]
) -> None:
    (agent,) = await open_episodes(agent_service)
    request: dict[str, Any] = {
        "model": "policy",
        "max_tokens": 256,
        "system": SYSTEM["content"],
        "tools": [TOOL],
    }
    messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION["content"]}]
    async with claude(agent) as llm:
        first = await llm.messages.create(messages=messages, **request)  # type: ignore[arg-type]
        messages.append(as_history(first))
        use = first.content[1]
        assert use.type == "tool_use"
        messages.append(
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]}
        )
        cut = await llm.messages.create(messages=messages, stop_sequences=["sunny"], **request)  # type: ignore[arg-type]
        assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == "sunny"
        assert [(block.type, block.text) for block in cut.content] == [("text", "It is")]  # type: ignore[union-attr]
        messages += [as_history(cut), {"role": "user", "content": "And tomorrow?"}]
        again = await llm.messages.create(messages=messages, **request)  # type: ignore[arg-type]
        assert again.stop_reason == "tool_use"
    assert (await finish(agent_service, agent, reward=1.0)).status_code == 200
    episode = (await agent_service.get(f"/episodes/{agent['episode_id']}")).json()
    assert episode["segments"] == 1 and episode["num_turns"] == 3
    calls = sim_calls(agent_sim[0], episode["id"], 0)
    assert_tokens_match_calls(episode, calls)
    (second,) = [request for request in agent_sim[0].requests if request.rid.endswith(":1")]
    assert second.sampling_params["stop"] == ["sunny"]


def test_a_matched_stop_sequence_and_its_stream() -> None:
    answer = Answer("Paris", "Cities.", stop_sequence="\n\n", prompt_tokens=9, completion_tokens=4)
    body = message_body(answer, "policy")
    assert body["stop_reason"] == "stop_sequence" and body["stop_sequence"] == "\n\n"
    assert [block["type"] for block in body["content"]] == ["thinking", "text"]
    events = replayed(MessageEvents("policy"), answer, prompt_tokens=9)
    assert events[0][1]["message"]["usage"]["input_tokens"] == 9
    assert [name for name, _ in events] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert [data["delta"]["type"] for name, data in events if name == "content_block_delta"] == [
        "thinking_delta",
        "signature_delta",
        "text_delta",
    ]
    assert events[-2][1]["usage"] == {"output_tokens": 4}
