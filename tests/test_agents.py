"""External agents (env `external`) driven by the `openai` package through their episodes' OpenAI
endpoints: tools, several turns, streaming, a rewritten history (a new segment), finishing, the
idle timeout, and tokens. An agent that only replays its conversation gets one segment with the
same invariants as the service's own loop."""

from __future__ import annotations

import asyncio
import io
import json
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pyarrow as pa
import pytest
from sqlalchemy import select, update

from service.agents.repository import AgentEpisode, Segment, StoredCall
from service.agents.service import HeldEpisodes
from service.app import create_app
from service.records import EpisodeTokens
from service.serving import serve_app
from service.sim.worker import SimRequest, SimWorker
from service.storage.blobs import TOKEN_BLOBS
from service.storage.db import Database, utcnow
from service.storage.models import Episode
from tests.conftest import service_settings
from tests.support.agents import ANSWER, QUESTION, SYSTEM, TOOLS, finish, open_episodes
from tests.support.contract import GenerateCall, assert_tokens_match_calls, generate_call, sim_calls
from tests.support.tokenizer import load_test_tokenizer

# The SDK is imported where it is used: at the top of the module, every pytest-xdist worker paid for
# it (about a second of CPU) while collecting, whether it ran these tests or not.
if TYPE_CHECKING:
    import openai


@pytest.fixture
def service(agent_service: httpx.AsyncClient) -> httpx.AsyncClient:
    return agent_service


def agent_client(agent: dict[str, Any]) -> openai.AsyncOpenAI:
    import openai

    return openai.AsyncOpenAI(base_url=agent["base_url"], api_key=agent["api_key"], max_retries=0)


def as_history(message: Any) -> dict[str, Any]:
    """The assistant message as an agent appends it to its history."""
    history: dict[str, Any] = message.model_dump(exclude_none=True)
    return history


async def play(agent: dict[str, Any], *, stream: bool = False) -> list[dict[str, Any]]:
    """Question, tool call, tool result, answer; returns the conversation."""
    async with agent_client(agent) as llm:
        return await converse(llm, stream)


async def converse(llm: openai.AsyncOpenAI, stream: bool) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [SYSTEM, QUESTION]
    first = await llm.chat.completions.create(model="policy", messages=messages, tools=TOOLS)  # type: ignore[arg-type]
    assert first.choices[0].finish_reason == "tool_calls"
    (call,) = first.choices[0].message.tool_calls or []
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert first.usage is not None and first.usage.completion_tokens > 0
    messages.append(as_history(first.choices[0].message))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"sky": "sunny"})})
    if stream:
        chunks = [
            chunk
            async for chunk in await llm.chat.completions.create(
                model="policy",
                messages=messages,  # type: ignore[arg-type]
                tools=TOOLS,  # type: ignore[arg-type]
                stream=True,
                stream_options={"include_usage": True},
            )
        ]
        text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
        finish = [
            chunk.choices[0].finish_reason
            for chunk in chunks
            if chunk.choices and chunk.choices[0].finish_reason
        ]
        assert finish == ["stop"] and chunks[-1].usage is not None and chunks[-1].choices == []
        messages.append({"role": "assistant", "content": text})
    else:
        second = await llm.chat.completions.create(model="policy", messages=messages, tools=TOOLS)  # type: ignore[arg-type]
        assert second.choices[0].finish_reason == "stop"
        text = second.choices[0].message.content or ""
        messages.append(as_history(second.choices[0].message))
    assert text == ANSWER
    return messages


def segment_calls(sim: SimWorker, episode: dict[str, Any], turns: list[dict[str, Any]]) -> list[GenerateCall]:
    calls = sim_calls(sim, episode["id"], 0)
    return [calls[turn["turn"]] for turn in turns]


async def test_an_agent_that_replays_its_conversation_gets_one_exact_segment(
    service: httpx.AsyncClient, agent_sim: tuple[SimWorker, str]
) -> None:
    external = next(env for env in (await service.get("/envs")).json() if env["name"] == "external")
    assert external["splits"] == {} and "OpenAI" in external["description"]
    (agent,) = await open_episodes(service)
    assert agent["base_url"].endswith(f"/v1/episodes/{agent['episode_id']}")
    await play(agent)
    assert (await finish(service, agent, reward=1.0, info={"judge": "ok"})).status_code == 200

    episode = (await service.get(f"/episodes/{agent['episode_id']}")).json()
    assert episode["status"] == "completed" and episode["reward"] == 1.0 and episode["segments"] == 1
    assert episode["info"] == {"judge": "ok"} and episode["num_turns"] == 2
    assert episode["earlier_segments"] == []
    calls = sim_calls(agent_sim[0], episode["id"], 0)
    assert len(calls) == 2
    assert_tokens_match_calls(episode, calls)
    # The prompt is the agent's first messages as the template renders them, with its tools.
    tokenizer = load_test_tokenizer()
    rendered = tokenizer.apply_chat_template(
        [SYSTEM, QUESTION], tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert episode["prompt_ids"] == tokenizer.encode(rendered, add_special_tokens=False)
    assert [turn["action"] for turn in episode["turns"]] == ["get_weather", None]

    batch = (await service.get(f"/batches/{episode['batch_id']}")).json()
    assert batch["complete"] and batch["episodes"][0]["reward"] == 1.0
    metrics = (await service.get("/metrics")).text
    assert 'rollout_episodes_finished_total{status="completed"} 1.0' in metrics


async def test_streamed_answers_are_recorded_the_same(
    service: httpx.AsyncClient, agent_sim: tuple[SimWorker, str]
) -> None:
    (agent,) = await open_episodes(service)
    await play(agent, stream=True)
    assert (await finish(service, agent, reward=0.5)).status_code == 200
    episode = (await service.get(f"/episodes/{agent['episode_id']}")).json()
    assert episode["segments"] == 1
    assert_tokens_match_calls(episode, sim_calls(agent_sim[0], episode["id"], 0))


async def test_a_rewritten_history_starts_a_new_segment(
    service: httpx.AsyncClient, agent_sim: tuple[SimWorker, str]
) -> None:
    (agent,) = await open_episodes(service)
    conversation = await play(agent)
    # The agent summarizes: the tool call and its result are gone from its history.
    summary = [SYSTEM, {"role": "user", "content": "Earlier: the weather in Paris is sunny. Is it still?"}]
    async with agent_client(agent) as llm:
        again = await llm.chat.completions.create(model="policy", messages=summary, tools=TOOLS)  # type: ignore[arg-type]
    assert again.choices[0].finish_reason == "tool_calls"
    assert (await finish(service, agent, reward=1.0)).status_code == 200

    episode = (await service.get(f"/episodes/{agent['episode_id']}")).json()
    assert episode["segments"] == 2 and episode["num_turns"] == 3
    (earlier,) = episode["earlier_segments"]
    assert earlier["segment"] == 0 and len(earlier["turns"]) == 2 and len(episode["turns"]) == 1
    sim = agent_sim[0]
    for segment in (earlier, episode):
        assert_tokens_match_calls(segment, segment_calls(sim, episode, segment["turns"]))
    assert len(conversation) == 5

    arrow = await service.get(
        f"/batches/{episode['batch_id']}", headers={"Accept": "application/vnd.apache.arrow.stream"}
    )
    rows = pa.ipc.open_stream(io.BytesIO(arrow.content)).read_all().to_pylist()
    assert [(row["episode_id"], row["segment"], row["segments"]) for row in rows] == [
        (episode["id"], 0, 2),
        (episode["id"], 1, 2),
    ]
    assert (
        rows[0]["response_ids"] == earlier["response_ids"] and rows[1]["prompt_ids"] == episode["prompt_ids"]
    )
    assert rows[0]["reward"] == rows[1]["reward"] == 1.0


async def test_each_episode_opens_with_its_own_token_only(
    database_url: str, agent_sim: tuple[SimWorker, str]
) -> None:
    # An API-only process (as `serve --api-processes`) answers agents too: it loads its tokenizer then.
    app = create_app(service_settings(database_url, agent_sim[1], api_keys="trainer-key", run_worker=False))
    async with serve_app(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        trainer = {"Authorization": "Bearer trainer-key"}
        response = await http.post(
            "/episodes", json={"env": "external", "task_indices": [0], "samples_per_task": 2}, headers=trainer
        )
        first, second = response.json()["agents"]
        path = f"/v1/episodes/{first['episode_id']}/chat/completions"
        body = {"model": "policy", "messages": [QUESTION]}
        for headers in ({}, {"Authorization": f"Bearer {second['api_key']}"}, {"Authorization": "Bearer x"}):
            assert (await http.post(path, json=body, headers=headers)).status_code == 401
        own = await http.post(path, json=body, headers={"Authorization": f"Bearer {first['api_key']}"})
        assert own.status_code == 200, own.text
        assert (await http.post(path, json={**body, "messages": []}, headers=trainer)).status_code == 422
        # Without the API key the trainer's routes stay closed to an agent's token.
        assert (
            await http.get("/batches", headers={"Authorization": f"Bearer {first['api_key']}"})
        ).status_code == 401


async def test_finished_and_idle_episodes_take_no_more_calls(
    database_url: str, db: Database, agent_sim: tuple[SimWorker, str]
) -> None:
    import openai

    # The idle one's time runs out when the test says (its deadline moved into the past), not on
    # the clock: with a 3 s limit, a loaded machine (load 20 on 2 cores) let the played episode
    # time out between its calls and its finish (409).
    settings = service_settings(
        database_url, agent_sim[1], external_idle_seconds=600, sweep_interval_seconds=0.2
    )
    async with serve_app(create_app(settings)) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        done, idle = await open_episodes(http, samples=2)
        opened = await idle_deadlines(db, done, idle)
        assert all(deadline - started == timedelta(seconds=600) for started, deadline in opened)
        refused = await finish(http, done, status="won", reward="1.0")
        assert refused.status_code == 422 and {tuple(e["loc"]) for e in refused.json()["errors"]} == {
            ("body", "status"),
            ("body", "reward"),
        }
        async with agent_client(done) as llm:  # a played episode: its status is the agent's
            await llm.chat.completions.create(model="policy", messages=[QUESTION])  # type: ignore[list-item]
        called, waiting = await idle_deadlines(db, done, idle)
        assert called[1] > opened[0][1] and waiting == opened[1]  # a call pushes its own deadline on
        assert (await finish(http, done, status="truncated", reward=0.0)).status_code == 200
        assert (await finish(http, done, reward=1.0)).status_code == 409
        async with agent_client(done) as llm:
            with pytest.raises(openai.ConflictError):
                await llm.chat.completions.create(model="policy", messages=[QUESTION])  # type: ignore[list-item]

        async with db.sessionmaker.begin() as session:
            await session.execute(
                update(Episode)
                .where(Episode.id == idle["episode_id"])
                .values(lease_expires_at=utcnow() - timedelta(seconds=1))
            )
        for _ in range(300):  # the service's sweep fails it within a round
            episode = (await http.get(f"/episodes/{idle['episode_id']}")).json()
            if episode["status"] != "running":
                break
            await asyncio.sleep(0.1)
        assert episode["status"] == "failed" and "timed out" in episode["error"]
        batch = (await http.get(f"/batches/{episode['batch_id']}", params={"wait": 10})).json()
        assert batch["complete"] and batch["counts"]["truncated"] == 1 and batch["counts"]["failed"] == 1


async def idle_deadlines(db: Database, *agents: dict[str, Any]) -> list[tuple[datetime, datetime]]:
    """(started_at, lease_expires_at) of each agent's episode: its idle deadline while it waits."""
    async with db.reader() as session:
        rows = {
            row.id: (row.started_at, row.lease_expires_at)
            for row in await session.execute(
                select(Episode.id, Episode.started_at, Episode.lease_expires_at).where(
                    Episode.id.in_([agent["episode_id"] for agent in agents])
                )
            )
        }
    return [rows[agent["episode_id"]] for agent in agents]


async def test_calls_through_two_processes_stay_exact(
    database_url: str, agent_sim: tuple[SimWorker, str]
) -> None:
    """Each process keeps what it stored of an episode; a call through the other one makes that
    stale, and the next call here reads the episode again instead of answering from it."""
    settings = service_settings(database_url, agent_sim[1], run_worker=False)
    async with serve_app(create_app(settings)) as first, serve_app(create_app(settings)) as second:
        async with httpx.AsyncClient(base_url=first, timeout=30) as http:
            (agent,) = await open_episodes(http)
        messages: list[dict[str, Any]] = [SYSTEM, QUESTION]
        for number, url in enumerate((first, second, first)):
            endpoint = {**agent, "base_url": f"{url}/v1/episodes/{agent['episode_id']}"}
            async with agent_client(endpoint) as llm:
                answer = await llm.chat.completions.create(model="policy", messages=messages, tools=TOOLS)  # type: ignore[arg-type]
            messages.append(as_history(answer.choices[0].message))
            messages.append({"role": "user", "content": f"And tomorrow ({number})?"})
        async with httpx.AsyncClient(base_url=second, timeout=30) as http:
            episode = (await http.get(f"/episodes/{agent['episode_id']}")).json()
    assert episode["num_turns"] == 3 and episode["segments"] == 1
    # The first process answered the third call from its stale state once (as call 1), then again
    # from the database; the stale answer was not stored: each turn's first request is the one.
    stale_rid = f"{agent['episode_id']}:0:1"
    assert sum(request.rid == stale_rid for request in agent_sim[0].requests) == 2
    first_requests: dict[str, SimRequest] = {}
    for request in agent_sim[0].requests:
        first_requests.setdefault(request.rid, request)
    calls = [generate_call(first_requests[f"{agent['episode_id']}:0:{turn}"]) for turn in range(3)]
    assert_tokens_match_calls(episode, calls)


async def test_a_wrong_token_is_refused_without_a_tokenizer(
    database_url: str, agent_sim: tuple[SimWorker, str], tmp_path: Path
) -> None:
    """Checking an agent's token reads its episode, nothing more: an API-only process whose
    tokenizer cannot even load answers 401s, 404s and finishes (a call would load it)."""
    broken = tmp_path / "no-tokenizer"
    broken.mkdir()
    settings = service_settings(
        database_url,
        agent_sim[1],
        run_worker=False,
        tokenizer_path=str(broken),
        tool_call_format="qwen25",  # not `auto`, which reads the template at start
    )
    async with serve_app(create_app(settings)) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        first, second = await open_episodes(http, samples=2)
        path = f"/v1/episodes/{first['episode_id']}/chat/completions"
        body = {"model": "policy", "messages": [QUESTION]}
        for headers in ({}, {"Authorization": f"Bearer {second['api_key']}"}, {"Authorization": "Basic x"}):
            refused = await http.post(path, json=body, headers=headers)
            assert refused.status_code == 401, refused.text
            assert refused.headers["WWW-Authenticate"] == "Bearer"
        unknown = await http.post(
            "/v1/episodes/nope/chat/completions", json=body, headers={"Authorization": "Bearer x"}
        )
        assert unknown.status_code == 404
        assert (await finish(http, first, reward=1.0)).status_code == 200
        assert (await finish(http, first, reward=1.0)).status_code == 409


def held(episode_id: str, size: int) -> StoredCall:
    episode = AgentEpisode(episode_id, "batch", 0, "running", 0, "token", {}, 8, None, 1, 1, None)
    blobs = {name: b"" for name in TOKEN_BLOBS} | {TOKEN_BLOBS[0]: b"x" * size}
    segment = Segment(EpisodeTokens([], [], [], []), [], [])  # no lists: its blobs are its size
    return StoredCall(episode, blobs | {"turns": [], "messages": []}, segment)


def test_held_episodes_are_bounded_by_their_token_bytes() -> None:
    cache = HeldEpisodes(max_bytes=100)
    cache.put("a", held("a", 40))
    cache.put("b", held("b", 40))
    assert cache.get("a") is not None  # now the most recently used
    cache.put("c", held("c", 40))  # evicts b, the least recently used
    assert cache.get("b") is None and cache.get("a") is not None and cache.get("c") is not None
    assert cache.bytes == 80
    cache.put("a", held("a", 10))  # replaced, not added
    assert cache.bytes == 50
    cache.put("c", held("c", 1_000))  # larger than the whole cache: not held, nor its older state
    assert cache.get("c") is None and cache.bytes == 10
    cache.pop("a")
    cache.pop("a")
    assert cache.bytes == 0


async def test_an_episode_finished_before_any_call_ends_failed(
    agent_service: httpx.AsyncClient,
) -> None:
    """A finish before the first call is no sample: it ends `failed` (trainers skip it) whatever
    status the agent gave, unless it said `aborted` or `failed` itself; its group still completes."""
    unplayed, aborted = await open_episodes(agent_service, samples=2)
    answer = await finish(agent_service, unplayed, reward=1.0)
    assert answer.status_code == 200 and answer.json()["status"] == "failed"
    assert (await finish(agent_service, aborted, status="aborted", error="no sandbox")).json()[
        "status"
    ] == "aborted"
    episode = (await agent_service.get(f"/episodes/{unplayed['episode_id']}")).json()
    assert episode["status"] == "failed" and "before its first call" in episode["error"]
    batch = (await agent_service.get(f"/batches/{episode['batch_id']}")).json()
    assert batch["complete"] and batch["counts"]["failed"] == 1 and batch["counts"]["aborted"] == 1


async def test_chat_completions_answer_alike_through_the_fast_path_and_the_route(
    service: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A JSON body of a declared length that validates takes ChatCompletionsFastPath; a chunked
    body (no Content-Length) takes the FastAPI route. Both store the call and answer alike,
    errors included: a message without a role, an unknown token, a body that does not validate
    (the route answers it for both), a query the route does not take."""
    from service.agents.chat_completions import ChatCompletionsFastPath

    fast_calls = 0
    answer = ChatCompletionsFastPath._answer

    async def counted(*args: Any) -> None:
        nonlocal fast_calls
        fast_calls += 1
        await answer(*args)

    monkeypatch.setattr(ChatCompletionsFastPath, "_answer", staticmethod(counted))
    fast, routed = await open_episodes(service, samples=2)

    async def post(
        agent: dict[str, Any], body: dict[str, Any], chunked: bool, **extra: Any
    ) -> httpx.Response:
        payload = json.dumps(body).encode()

        async def pieces() -> Any:
            yield payload

        headers = {"Authorization": f"Bearer {agent['api_key']}", "Content-Type": "application/json"}
        return await service.post(
            f"/v1/episodes/{agent['episode_id']}/chat/completions",
            content=pieces() if chunked else payload,
            headers=headers | extra.pop("headers", {}),
            **extra,
        )

    call = {"model": "policy", "messages": [QUESTION], "tools": TOOLS}
    answers = [await post(fast, call, chunked=False), await post(routed, call, chunked=True)]
    assert fast_calls == 1
    for response in answers:
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    for agent in (fast, routed):
        assert (await service.get(f"/episodes/{agent['episode_id']}")).json()["num_turns"] == 1

    no_role = {"model": "policy", "messages": [{"content": "Hi"}]}
    for body, extra, status in [
        (no_role, {}, 422),
        (call, {"headers": {"Authorization": "Bearer not-its-token"}}, 401),
        ({**call, "messages": []}, {}, 422),
        ({**call, "temperature": -1}, {}, 422),
        (call, {"params": {"include_token": "true"}}, 422),
    ]:
        both = [
            await post(fast, body, chunked=False, **extra),
            await post(fast, body, chunked=True, **extra),
        ]
        assert [response.status_code for response in both] == [status, status], [r.text for r in both]
        assert both[0].json() == both[1].json()
    assert fast_calls == 3  # the role and the token: the bodies that validate, without a query
    error = (await post(fast, no_role, chunked=False)).json()
    assert error["error"]["param"] == "messages.0.role", error
