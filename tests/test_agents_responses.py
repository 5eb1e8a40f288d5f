"""External agents on their episodes' Responses endpoint: the `openai` package's responses.create
(plain, streamed, previous_response_id) and the OpenAI Agents SDK running an agent with a function
tool over several turns. An agent that replays its history (or chains its responses) gets one
segment, exact against the engine's request log."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from agents import Agent, OpenAIResponsesModel, RunConfig, Runner, function_tool

from service.agents.conversation import Answer, ToolCall
from service.agents.openai_responses import ResponseEvents, ResponsesRequest, response_body
from service.sim.worker import SimWorker
from tests.support.agents import ANSWER, QUESTION, SYSTEM, TOOLS, finish, open_episodes, replayed
from tests.support.contract import assert_tokens_match_calls, sim_calls
from tests.support.tokenizer import load_test_tokenizer

TOOL = {"type": "function", **TOOLS[0]["function"]}  # type: ignore[dict-item]


def llm(agent: dict[str, Any]) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=agent["base_url"], api_key=agent["api_key"], max_retries=0)


async def stored_exactly(
    http: httpx.AsyncClient, sim: SimWorker, agent: dict[str, Any], calls: int
) -> dict[str, Any]:
    assert (await finish(http, agent, reward=1.0)).status_code == 200
    episode: dict[str, Any] = (await http.get(f"/episodes/{agent['episode_id']}")).json()
    assert episode["status"] == "completed" and episode["segments"] == 1 and episode["num_turns"] == calls
    requests = sim_calls(sim, episode["id"], 0)
    assert len(requests) == calls
    assert_tokens_match_calls(episode, requests)
    return episode


async def test_chained_responses_get_one_exact_segment(
    agent_service: httpx.AsyncClient, agent_sim: tuple[SimWorker, str]
) -> None:
    (agent,) = await open_episodes(agent_service)
    async with llm(agent) as client:
        first = await client.responses.create(
            model="policy",
            instructions=SYSTEM["content"],
            input=QUESTION["content"],
            tools=[TOOL],
            store=True,  # type: ignore[list-item]
        )
        assert first.status == "completed" and first.usage is not None and first.usage.output_tokens > 0
        reasoning, call = first.output
        assert reasoning.type == "reasoning" and reasoning.content is not None
        assert reasoning.content[0].text == "The user wants the weather."
        assert call.type == "function_call" and call.name == "get_weather"
        assert json.loads(call.arguments) == {"city": "Paris"}
        result = {
            "type": "function_call_output",
            "call_id": call.call_id,
            "output": json.dumps({"sky": "sunny"}),
        }
        second = await client.responses.create(
            model="policy",
            instructions=SYSTEM["content"],
            previous_response_id=first.id,
            input=[result],  # type: ignore[list-item]
            tools=[TOOL],  # type: ignore[list-item]
        )
        assert second.output_text == ANSWER and second.previous_response_id == first.id
        with pytest.raises(openai.UnprocessableEntityError, match="latest answer"):  # not chained twice
            await client.responses.create(model="policy", previous_response_id=first.id, input="Thanks!")
    episode = await stored_exactly(agent_service, agent_sim[0], agent, calls=2)
    tokenizer = load_test_tokenizer()
    rendered = tokenizer.apply_chat_template(
        [SYSTEM, QUESTION], tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert episode["prompt_ids"] == tokenizer.encode(rendered, add_special_tokens=False)
    assert episode["messages"][-2]["role"] == "tool" and episode["messages"][-2]["name"] == "get_weather"


async def test_streamed_responses_replaying_their_items_are_recorded_the_same(
    agent_service: httpx.AsyncClient, agent_sim: tuple[SimWorker, str]
) -> None:
    (agent,) = await open_episodes(agent_service)
    items: list[Any] = [{"role": "user", "content": QUESTION["content"]}]
    kinds: list[str] = []
    async with llm(agent) as client:
        for _ in range(2):
            stream = await client.responses.create(
                model="policy",
                instructions=SYSTEM["content"],
                input=items,
                tools=[TOOL],
                stream=True,  # type: ignore[list-item]
            )
            events = [event async for event in stream]
            kinds += [event.type for event in events]
            assert [event.sequence_number for event in events] == list(range(len(events)))
            (completed,) = [event for event in events if event.type == "response.completed"]
            output = completed.response.output  # type: ignore[union-attr]
            items += [item.model_dump(exclude_none=True) for item in output]
            calls = [item for item in output if item.type == "function_call"]
            items += [
                {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"} for call in calls
            ]
    assert completed.response.output_text == ANSWER  # type: ignore[union-attr]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert {
        "response.output_item.added",
        "response.reasoning_text.delta",
        "response.function_call_arguments.delta",
        "response.output_text.delta",
        "response.output_item.done",
    } <= set(kinds)
    await stored_exactly(agent_service, agent_sim[0], agent, calls=2)


async def run(agent: Agent[Any], given: Any, config: RunConfig, streamed: bool) -> Any:
    if not streamed:
        return await Runner.run(agent, given, run_config=config)
    result = Runner.run_streamed(agent, given, run_config=config)
    async for _ in result.stream_events():
        pass
    return result


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
async def test_an_agents_sdk_agent_over_several_turns_gets_one_exact_segment(
    agent_service: httpx.AsyncClient, agent_sim: tuple[SimWorker, str], streamed: bool
) -> None:
    (agent,) = await open_episodes(agent_service)
    cities: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        cities.append(city)
        return json.dumps({"sky": "sunny"})

    async with llm(agent) as client:
        assistant = Agent(name="weather", instructions=SYSTEM["content"], tools=[get_weather])
        config = RunConfig(model=OpenAIResponsesModel("policy", client), tracing_disabled=True)
        first = await run(assistant, QUESTION["content"], config, streamed)
        assert first.final_output == ANSWER
        again = [*first.to_input_list(), {"role": "user", "content": "And tomorrow?"}]
        second = await run(assistant, again, config, streamed)
        assert second.final_output == ANSWER
    assert cities == ["Paris", "Paris"]
    episode = await stored_exactly(agent_service, agent_sim[0], agent, calls=4)
    assert [turn["action"] for turn in episode["turns"]] == ["get_weather", None, "get_weather", None]


async def test_refusals_and_a_cut_answer(agent_service: httpx.AsyncClient) -> None:
    first, second = await open_episodes(agent_service, samples=2)
    async with llm(first) as client:
        with pytest.raises(openai.UnprocessableEntityError, match="built-in tools"):
            await client.responses.create(model="policy", input="Hi", tools=[{"type": "web_search"}])
        cut = await client.responses.create(model="policy", input="Hi", max_output_tokens=3)
        assert cut.status == "incomplete" and cut.incomplete_details is not None
        assert cut.incomplete_details.reason == "max_output_tokens" and cut.usage.output_tokens == 3  # type: ignore[union-attr]
        for previous in ("resp_nope_0", f"resp_{second['episode_id']}_0", f"resp_{first['episode_id']}_7"):
            with pytest.raises(openai.UnprocessableEntityError, match=r"previous_response_id|latest answer"):
                await client.responses.create(model="policy", input="Hi", previous_response_id=previous)
        with pytest.raises(openai.UnprocessableEntityError):
            await client.responses.create(model="policy", input=[{"type": "item_reference", "id": "x"}])  # type: ignore[list-item]


def test_a_cut_answers_stream_ends_incomplete() -> None:
    answer = Answer("Par", None, [ToolCall("call_0_0", "f", {})], finish_reason="length", completion_tokens=3)
    body = response_body(ResponsesRequest(input="Hi"), answer, "e")
    assert body["status"] == "incomplete" and [item["type"] for item in body["output"]] == [
        "message",
        "function_call",
    ]
    events = [data for _, data in replayed(ResponseEvents(ResponsesRequest(input="Hi"), "e", 0), answer)]
    assert events[-1]["type"] == "response.incomplete" and events[-1]["sequence_number"] == len(events) - 1
    assert events[-1]["response"]["output"] == body["output"]
    done = [event["item"] for event in events if event["type"] == "response.output_item.done"]
    assert done == body["output"]  # each item as streamed is the one the response carries
