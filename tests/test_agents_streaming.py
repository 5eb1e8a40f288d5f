"""True streaming for external agents: each protocol's stream (the real `openai` and `anthropic`
SDKs) carries the text as the engine samples it, token by token from SGLang's streaming
/generate (the simulated worker paces its tokens); what is stored is what the non-streamed call
stores; an agent that goes away mid-stream aborts the generation, and what was sampled is the
call's record (checked against the engine's request log)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import orjson
import pytest

from service.agents.chat_completions import CompletionChunks
from service.agents.conversation import Answer, ToolCall
from service.agents.streaming import GONE, TextDeltas, shown_text
from service.app import create_app
from service.serving import serve_app
from service.sim.worker import SimConfig, SimWorker, create_sim_app, serve_in_thread
from tests.conftest import service_settings
from tests.support.agents import open_episodes
from tests.support.contract import assert_tokens_match_calls, sim_calls
from tests.support.tokenizer import load_test_tokenizer

LONG = "The forecast says " + "sunny and warm, " * 12 + "all week."
PER_TOKEN_SECONDS = 0.02
QUESTION = [{"role": "user", "content": "How is the weather?"}]


@pytest.fixture
def paced_sim() -> Iterator[tuple[SimWorker, str]]:
    """A worker that samples a token every PER_TOKEN_SECONDS and streams each one."""
    config = SimConfig(
        latency_seconds=0.01,
        per_token_latency_seconds=PER_TOKEN_SECONDS,
        stream_interval=1,
        noncanonical_rate=0.0,  # the same ids for every episode: streamed and plain ones compare
        policy=lambda prompt, key: LONG,
    )
    worker = SimWorker(config)
    with serve_in_thread(create_sim_app(config, worker=worker)) as url:
        yield worker, url


@pytest.fixture
async def service(database_url: str, paced_sim: tuple[SimWorker, str]) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(service_settings(database_url, paced_sim[1], external_idle_seconds=600))
    async with serve_app(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        yield http


# A stream's pieces as they arrive, each with whether the engine was still sampling the call then.
Pieces = list[tuple[bool, str]]


# Each SDK is imported where it is used: at the top of the module, every pytest-xdist worker paid for
# them (seconds of CPU) while collecting, whether it ran these tests or not.
async def _chat(agent: dict[str, Any], sampling: Callable[[], bool]) -> Pieces:
    import openai

    async with openai.AsyncOpenAI(base_url=agent["base_url"], api_key=agent["api_key"], max_retries=0) as llm:
        chunks = await llm.chat.completions.create(model="policy", messages=QUESTION, stream=True)  # type: ignore[arg-type]
        return [
            (sampling(), chunk.choices[0].delta.content)
            async for chunk in chunks
            if chunk.choices and chunk.choices[0].delta.content
        ]


async def _messages(agent: dict[str, Any], sampling: Callable[[], bool]) -> Pieces:
    import anthropic

    base_url = agent["base_url"]
    async with anthropic.AsyncAnthropic(base_url=base_url, api_key=agent["api_key"], max_retries=0) as llm:
        async with llm.messages.stream(model="policy", max_tokens=256, messages=QUESTION) as events:  # type: ignore[arg-type]
            return [(sampling(), text) async for text in events.text_stream if text]


async def _responses(agent: dict[str, Any], sampling: Callable[[], bool]) -> Pieces:
    import openai

    async with openai.AsyncOpenAI(base_url=agent["base_url"], api_key=agent["api_key"], max_retries=0) as llm:
        events = await llm.responses.create(model="policy", input="How is the weather?", stream=True)
        return [
            (sampling(), event.delta) async for event in events if event.type == "response.output_text.delta"
        ]


async def _plain(agent: dict[str, Any]) -> None:
    import openai

    async with openai.AsyncOpenAI(base_url=agent["base_url"], api_key=agent["api_key"], max_retries=0) as llm:
        answer = await llm.chat.completions.create(model="policy", messages=QUESTION)  # type: ignore[arg-type]
        assert answer.choices[0].message.content == LONG


PROTOCOLS = {"chat_completions": _chat, "messages": _messages, "responses": _responses}


@pytest.mark.parametrize("protocol", list(PROTOCOLS))
async def test_a_streamed_answer_arrives_as_sampled_and_is_stored_as_a_plain_one(
    service: httpx.AsyncClient, paced_sim: tuple[SimWorker, str], protocol: str
) -> None:
    warm_up, streamed, plain = await open_episodes(service, samples=3)

    def sampling() -> bool:  # the engine runs one call at a time here: this one's
        return paced_sim[0].running > 0

    await PROTOCOLS[protocol](warm_up, sampling)  # an SDK builds its event types on first use
    deltas = await PROTOCOLS[protocol](streamed, sampling)
    await _plain(plain)
    assert "".join(text for _, text in deltas) == LONG
    # Token by token, as the engine samples them: many pieces; the last quarter of the text in many
    # of its own (not the rest at once); the first quarter of the text with the agent while the
    # engine was still sampling (not held to the end). Asked of the engine, not of the clock: under
    # load the process stalls, and the engine, paced by the clock, sends what it owes in a burst
    # (3 of 4 pieces once came in the last 0.4 s of 2 s: random-order seed 1001, chunk_00).
    tokens = len(load_test_tokenizer().encode(LONG, add_special_tokens=False))
    assert len(deltas) >= tokens // 2
    ends = list(itertools.accumulate(len(text) for _, text in deltas))
    assert sum(1 for end in ends if end > len(LONG) * 3 // 4) >= tokens // 8
    first_quarter = next(i for i, end in enumerate(ends) if end >= len(LONG) // 4)
    assert all(busy for busy, _ in deltas[: first_quarter + 1]), [busy for busy, _ in deltas]

    rows = [(await service.get(f"/episodes/{agent['episode_id']}")).json() for agent in (streamed, plain)]
    for row in rows:
        assert_tokens_match_calls(row, sim_calls(paced_sim[0], row["id"], 0))
        assert row["num_turns"] == 1 and row["segments"] == 1
    same = ("prompt_ids", "response_ids", "loss_mask", "messages")
    assert {name: rows[0][name] for name in same} == {name: rows[1][name] for name in same}
    # The stream's own request to the engine was a streamed /generate.
    (request,) = [r for r in paced_sim[0].requests if r.rid.startswith(streamed["episode_id"])]
    assert request.body.get("stream") is True


async def test_an_agent_that_leaves_mid_stream_aborts_and_records_what_was_sampled(
    service: httpx.AsyncClient, paced_sim: tuple[SimWorker, str]
) -> None:
    (agent,) = await open_episodes(service)
    headers = {"Authorization": f"Bearer {agent['api_key']}"}
    body = {"model": "policy", "messages": QUESTION, "stream": True}
    url = f"/v1/episodes/{agent['episode_id']}/chat/completions"
    async with service.stream("POST", url, json=body, headers=headers) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if '"content":"The' in line:
                break  # gone after the first words
    for _ in range(200):
        row = (await service.get(f"/episodes/{agent['episode_id']}")).json()
        if row["num_turns"] == 1:
            break
        await asyncio.sleep(0.05)
    assert row["num_turns"] == 1 and row["status"] == "running"  # the agent may call again
    (turn,) = row["turns"]
    assert turn["finish_reason"]["type"] == "abort" and turn["finish_reason"]["message"] == GONE
    tokens = len(load_test_tokenizer().encode(LONG, add_special_tokens=False))
    assert 0 < turn["output_tokens"] < tokens  # aborted well before the end
    assert_tokens_match_calls(row, sim_calls(paced_sim[0], row["id"], 0))
    assert any(abort.get("rid", "").startswith(agent["episode_id"]) for abort in paced_sim[0].aborts)
    message = row["messages"][-1]
    assert message["role"] == "assistant" and LONG.startswith(message["content"]) and message["content"]


def test_shown_text_holds_back_what_may_become_a_tool_call_or_a_stop() -> None:
    assert shown_text("Sure. <tool_", ("<tool_call>",)) == "Sure."
    assert shown_text("Sure. <tool_call>\n{", ("<tool_call>",)) == "Sure."
    assert shown_text("a < b ", ("<tool_call>",)) == "a < b"
    assert shown_text("end\n\nEN", ("END",)) == "end"
    assert shown_text("caf\ufffd", ()) == "caf"
    # The longest tail that may open a marker is held, where its first character recurs in it.
    assert shown_text("a <<tool", ("<tool_call>",)) == "a <"
    assert shown_text("x <|<|chan", ("<|channel|>", "<|python_tag|>")) == "x <|"
    assert shown_text("ENEN", ("ENEND",)) == ""
    assert shown_text("ab <tool_call", ("<tool_call>", "b <")) == "a"
    tokenizer = load_test_tokenizer()
    ids = tokenizer.encode("<think>Hmm.</think>\nIt is sunny.", add_special_tokens=False)
    deltas = TextDeltas(lambda sampled: tokenizer.decode(sampled), [])
    shown = [delta for index in range(len(ids)) for delta in deltas.add(ids[index : index + 1])]
    assert "".join(text for kind, text in shown if kind == "reasoning") == "Hmm."
    assert "".join(text for kind, text in shown if kind == "content") == "It is sunny."


def test_completion_chunks_are_the_bytes_of_each_whole_chunk() -> None:
    """Each chunk's head is written once: the bytes are still orjson's of the whole chunk."""
    chunks = CompletionChunks('a "quoted" m\u00f6del', include_usage=True)
    answer = Answer(
        content=None,
        reasoning=None,
        tool_calls=[ToolCall(id="call_0_0", name="bash", arguments={"command": "ls"})],
        finish_reason="tool_calls",
        sampled="",
        call=0,
        prompt_tokens=3,
        completion_tokens=4,
    )
    events = [*chunks.delta("content", 'say "hi"\n'), *chunks.end(answer)]
    choices = [
        {"index": 0, "delta": {"content": 'say "hi"\n'}, "logprobs": None, "finish_reason": None},
        {"index": 0, "delta": {"tool_calls": [{"index": 0, **answer.message["tool_calls"][0]}]},
         "logprobs": None, "finish_reason": None},
        {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "tool_calls"},
    ]  # fmt: skip
    usage = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    expected = [orjson.dumps({**chunks.head, "choices": [choice]}) for choice in choices]
    expected.append(orjson.dumps({**chunks.head, "choices": [], "usage": usage}))
    assert events == [b"data: " + body + b"\n\n" for body in expected] + [b"data: [DONE]\n\n"]
