"""External agents on their episodes' Responses endpoint: the `openai` package's responses.create
(plain, streamed, previous_response_id) and the OpenAI Agents SDK running an agent with a function
tool over several turns. An agent that replays its history (or chains its responses) gets one
segment, exact against the engine's request log."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from service.agents.conversation import Answer, ToolCall, template_message
from service.agents.openai_responses import ResponseEvents, ResponsesRequest, response_body
from service.sim.worker import SimWorker
from tests.support.agents import ANSWER, QUESTION, SYSTEM, TOOLS, finish, open_episodes, replayed
from tests.support.contract import assert_tokens_match_calls, sim_calls
from tests.support.tokenizer import load_test_tokenizer

# The SDKs are imported where they are used: at the top of the module, every pytest-xdist worker paid
# for them (seconds of CPU) while collecting, whether it ran these tests or not.
if TYPE_CHECKING:
    import openai
    from agents import Agent, RunConfig

TOOL = {"type": "function", **TOOLS[0]["function"]}  # type: ignore[dict-item]


def llm(agent: dict[str, Any]) -> openai.AsyncOpenAI:
    import openai

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
    episode = await stored_exactly(agent_service, agent_sim[0], agent, calls=2)
    tokenizer = load_test_tokenizer()
    rendered = tokenizer.apply_chat_template(
        [SYSTEM, QUESTION], tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert episode["prompt_ids"] == tokenizer.encode(rendered, add_special_tokens=False)
    assert episode["messages"][-2]["role"] == "tool" and episode["messages"][-2]["name"] == "get_weather"


async def test_a_response_continued_from_an_earlier_one_branches_into_a_new_exact_segment(
    agent_service: httpx.AsyncClient, agent_sim: tuple[SimWorker, str]
) -> None:
    import openai

    agent, other = await open_episodes(agent_service, samples=2)
    episode_id = agent["episode_id"]

    def output(call: Any, sky: str) -> list[Any]:
        return [{"type": "function_call_output", "call_id": call.call_id, "output": sky}]

    async with llm(agent) as client:

        async def respond(previous: str | None, given: Any) -> Any:
            return await client.responses.create(
                model="policy",
                instructions=SYSTEM["content"],
                input=given,
                tools=[TOOL],  # type: ignore[list-item]
                **({"previous_response_id": previous} if previous else {}),  # type: ignore[arg-type]
            )

        first = await respond(None, QUESTION["content"])  # segment 0: calls 0 and 1
        call = first.output[-1]
        assert call.type == "function_call"
        sunny = await respond(first.id, output(call, "sunny"))
        # Call 0 again, another tool result: segment 0 closes, segment 1 holds call 2.
        rainy = await respond(first.id, output(call, "rainy"))
        assert rainy.output_text == ANSWER and rainy.previous_response_id == first.id
        # Call 1, in the closed segment (read back from the database): segment 2, calls 3 and 4.
        rome = await respond(sunny.id, "And in Rome?")
        assert rome.output[-1].type == "function_call"
        last = await respond(rome.id, output(rome.output[-1], "cloudy"))
        assert last.output_text == ANSWER
        responses = [first.id, sunny.id, rainy.id, rome.id, last.id]
        assert responses == [f"resp_{episode_id}_{n}" for n in range(5)]

        refused = {
            "resp_nope_0": "not a response of episode",  # malformed
            f"resp_{other['episode_id']}_0": "not a response of episode",  # another episode's
            f"resp_{episode_id}_x": "not a response of episode",
            f"resp_{episode_id}_\u00b2": "not a response of episode",  # a digit, not an ASCII one
            f"resp_{episode_id}_5": "has no response 5",  # not made (yet)
            f"resp_{episode_id}_99": "has no response 99",
        }
        for previous, why in refused.items():
            with pytest.raises(openai.UnprocessableEntityError, match=why) as refusal:
                await respond(previous, "Hi")
            assert refusal.value.param == "previous_response_id"
            assert refusal.value.type == "invalid_request_error"

    assert (await finish(agent_service, agent, reward=1.0)).status_code == 200
    episode = (await agent_service.get(f"/episodes/{episode_id}")).json()
    assert episode["status"] == "completed" and episode["num_turns"] == 5 and episode["segments"] == 3
    closed, branched = episode["earlier_segments"]
    segments = [closed, branched, episode]
    assert [[turn["turn"] for turn in segment["turns"]] for segment in segments] == [[0, 1], [2], [3, 4]]
    calls = sim_calls(agent_sim[0], episode_id, 0)
    assert len(calls) == 5  # the refused ones never reached the engine
    for segment in segments:
        assert_tokens_match_calls(segment, [calls[turn["turn"]] for turn in segment["turns"]])
    # Each branch's prompt is the conversation through the response it continues, then its input,
    # rendered whole by the template: the earlier answer as it was sampled.
    _, system, question, answer, sunny_result, sunny_answer = closed["messages"]
    assert answer["sampled"] and sunny_result["content"] == "sunny"
    assert branched["messages"][1:4] == [system, question, answer]
    assert branched["messages"][4] == {**sunny_result, "content": "rainy"}
    assert episode["messages"][1:6] == [system, question, answer, sunny_result, sunny_answer]
    assert episode["messages"][6] == {"role": "user", "content": "And in Rome?"}
    tokenizer = load_test_tokenizer()
    for segment, prompt in ((branched, branched["messages"][1:5]), (episode, episode["messages"][1:7])):
        rendered = tokenizer.apply_chat_template(
            [template_message(message) for message in prompt],
            tools=TOOLS,
            tokenize=False,
            add_generation_prompt=True,
        )
        assert segment["prompt_ids"] == tokenizer.encode(rendered, add_special_tokens=False)


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
    from agents import Runner

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
    from agents import Agent, OpenAIResponsesModel, RunConfig, function_tool

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


async def test_an_agents_sdk_agent_chaining_its_responses_and_branching_from_an_earlier_one(
    agent_service: httpx.AsyncClient, agent_sim: tuple[SimWorker, str]
) -> None:
    from agents import Agent, OpenAIResponsesModel, RunConfig, Runner, function_tool

    (agent,) = await open_episodes(agent_service)

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return json.dumps({"sky": "sunny"})

    async with llm(agent) as client:
        assistant = Agent(name="weather", instructions=SYSTEM["content"], tools=[get_weather])
        config = RunConfig(model=OpenAIResponsesModel("policy", client), tracing_disabled=True)
        first = await Runner.run(
            assistant, QUESTION["content"], run_config=config, auto_previous_response_id=True
        )
        again = await Runner.run(
            assistant, "And tomorrow?", run_config=config, previous_response_id=first.last_response_id
        )
        branch = await Runner.run(  # the first run's answer again, another question: a new segment
            assistant, "And in Rome?", run_config=config, previous_response_id=first.last_response_id
        )
    assert first.final_output == again.final_output == branch.final_output == ANSWER
    assert (await finish(agent_service, agent, reward=1.0)).status_code == 200
    episode = (await agent_service.get(f"/episodes/{agent['episode_id']}")).json()
    assert episode["num_turns"] == 6 and episode["segments"] == 2
    (earlier,) = episode["earlier_segments"]
    assert [turn["turn"] for turn in earlier["turns"]] == [0, 1, 2, 3]
    assert [turn["turn"] for turn in episode["turns"]] == [4, 5]
    calls = sim_calls(agent_sim[0], episode["id"], 0)
    for segment in (earlier, episode):
        assert_tokens_match_calls(segment, [calls[turn["turn"]] for turn in segment["turns"]])
    assert episode["messages"][1:6] == earlier["messages"][1:6]  # through the first run's answer


async def test_refusals_and_a_cut_answer(agent_service: httpx.AsyncClient) -> None:
    import openai

    (first,) = await open_episodes(agent_service)
    async with llm(first) as client:
        with pytest.raises(openai.UnprocessableEntityError, match="built-in tools"):
            await client.responses.create(model="policy", input="Hi", tools=[{"type": "web_search"}])
        cut = await client.responses.create(model="policy", input="Hi", max_output_tokens=3)
        assert cut.status == "incomplete" and cut.incomplete_details is not None
        assert cut.incomplete_details.reason == "max_output_tokens" and cut.usage.output_tokens == 3  # type: ignore[union-attr]
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
