"""The public API over real HTTP, on SQLite and PostgreSQL, against a simulated SGLang worker."""

from __future__ import annotations

import asyncio
import io
import socket
import time
from typing import Any

import httpx
import pyarrow as pa
import pytest
from sqlalchemy import func, select

from service.app import create_app
from service.serving import serve_app
from service.sim.worker import SimWorker
from service.storage.db import Database
from service.storage.models import Batch, Episode
from tests.conftest import service_settings
from tests.support.contract import assert_stored_episode_matches_sim
from tests.support.openai_stub import closed_port_url
from tests.support.tokenizer import chat_tokenizer

ARROW = "application/vnd.apache.arrow.stream"


def submission(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "env": "builtin/shop",
        "task_split": "test",
        "task_indices": [0, 1, 2],
        "samples_per_task": 2,
        "sampling_params": {"temperature": 0.7, "max_new_tokens": 200},
        "max_turns": 10,
        "metadata": {"step": 7},
    }
    body.update(overrides)
    return body


async def wait_complete(client: httpx.AsyncClient, batch_id: str, seconds: float = 60) -> dict[str, Any]:
    response = await client.get(f"/batches/{batch_id}", params={"wait": seconds})
    assert response.status_code == 200, response.text
    batch: dict[str, Any] = response.json()
    assert batch["complete"], batch["counts"]
    return batch


async def test_submit_run_and_pull_exact_tokens(
    client: httpx.AsyncClient, sim: tuple[SimWorker, str]
) -> None:
    response = await client.post("/episodes", json=submission(batch_id="b-1"))
    assert response.status_code == 202, response.text
    accepted = response.json()
    assert accepted["batch_id"] == "b-1" and accepted["created"] is True
    assert len(accepted["episode_ids"]) == 6

    batch = await wait_complete(client, "b-1")
    assert batch["total"] == 6 and batch["finished"] == 6
    assert batch["groups_total"] == batch["groups_complete"] == 3
    assert batch["metadata"] == {"step": 7}
    assert [(e["group_index"], e["sample_index"]) for e in batch["episodes"]] == [
        (g, s) for g in range(3) for s in range(2)
    ]

    chat = chat_tokenizer()
    for summary in batch["episodes"]:
        episode = (await client.get(f"/episodes/{summary['id']}")).json()
        assert episode["status"] in {"completed", "truncated", "aborted"}
        assert_stored_episode_matches_sim(sim[0], episode)
        # The stored ids decode to the transcript, as one render of the chat template shows it.
        text = chat.decode(episode["prompt_ids"] + episode["response_ids"])
        assert text.startswith(
            chat.render(episode["messages"][:2], tools=[{}], add_generation_prompt=True)[:20]
        )
        for message in episode["messages"]:
            assert message["content"] in text
        assert "task" in episode["info"]  # ground truth, for the trainer
        assert episode["info"]["task"]["instruction"] == episode["messages"][1]["content"]
        assert episode["messages"][0]["content"] not in str(episode["info"]["task"]["actions"])
        if episode["status"] == "completed":
            assert episode["reward"] in (0.0, 1.0)

    arrow = await client.get("/batches/b-1", headers={"Accept": ARROW})
    assert arrow.headers["content-type"] == ARROW
    table = pa.ipc.open_stream(io.BytesIO(arrow.content)).read_all()
    assert table.num_rows == 6
    for row in table.to_pylist():
        episode = (await client.get(f"/episodes/{row['episode_id']}")).json()
        assert row["response_ids"] == episode["response_ids"]
        assert row["prompt_ids"] == episode["prompt_ids"]
        assert row["loss_mask"] == episode["loss_mask"]
        assert row["rollout_logprobs"] == episode["rollout_logprobs"]
        assert row["weight_versions"] == episode["weight_versions"]


async def test_resubmission_is_idempotent_and_conflicts_are_409(client: httpx.AsyncClient) -> None:
    first = await client.post("/episodes", json=submission(batch_id="same"))
    again = await client.post("/episodes", json=submission(batch_id="same"))
    assert first.status_code == again.status_code == 202
    assert again.json()["episode_ids"] == first.json()["episode_ids"]
    assert again.json()["created"] is False
    conflict = await client.post("/episodes", json=submission(batch_id="same", samples_per_task=3))
    assert conflict.status_code == 409
    assert "same" in conflict.json()["detail"]


async def test_concurrent_resubmissions_create_one_batch(client: httpx.AsyncClient, db: Database) -> None:
    responses = await asyncio.gather(
        *(client.post("/episodes", json=submission(batch_id="race")) for _ in range(5))
    )
    assert {response.status_code for response in responses} == {202}
    assert len({tuple(response.json()["episode_ids"]) for response in responses}) == 1
    async with db.sessionmaker() as session:
        assert await session.scalar(select(func.count()).select_from(Episode)) == 6


@pytest.mark.parametrize(
    ("body", "status", "names"),
    [
        (submission(env="nope"), 422, ["env", "builtin/shop"]),
        (submission(task_split="validation"), 422, ["task_split", "test", "train"]),
        (submission(task_indices=[0, 50]), 422, ["task_indices.1", "0..49"]),
        (submission(task_indices=[]), 422, ["task_indices"]),
        (submission(samples_per_task=0), 422, ["samples_per_task"]),
        (submission(sampling_params={"temprature": 1.0}), 422, ["sampling_params.temprature"]),
        (submission(max_turns=0), 422, ["max_turns"]),
        (submission(batch_id="has space"), 422, ["batch_id"]),
        (submission(max_response_tokens=2**63), 422, ["max_response_tokens"]),
        (submission(sampling_params={"presence_penalty": "NaN"}), 422, ["sampling_params.presence_penalty"]),
        (submission(sampling_params={"stop_token_ids": [-1]}), 422, ["sampling_params.stop_token_ids.0"]),
        (submission(task_indices=list(range(50)), samples_per_task=1000), 413, ["50000 episodes"]),
    ],
)
async def test_bad_input_names_the_field_and_writes_nothing(
    client: httpx.AsyncClient, db: Database, body: dict[str, Any], status: int, names: list[str]
) -> None:
    response = await client.post("/episodes", json=body)
    assert response.status_code == status, response.text
    for name in names:
        assert name in response.json()["detail"]
    async with db.sessionmaker() as session:
        assert await session.scalar(select(func.count()).select_from(Batch)) == 0
        assert await session.scalar(select(func.count()).select_from(Episode)) == 0


async def test_malformed_json_and_oversized_bodies(client: httpx.AsyncClient) -> None:
    malformed = await client.post(
        "/episodes", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert malformed.status_code == 422
    assert "JSON" in malformed.json()["detail"]
    huge = {"metadata": {"blob": "x" * 2_000_000}}
    too_large = await client.post("/episodes", json=submission(**huge))
    assert too_large.status_code == 413

    async def chunks() -> Any:
        for _ in range(40):
            yield b" " * 65536

    streamed = await client.post("/episodes", content=chunks(), headers={"content-type": "application/json"})
    assert streamed.status_code == 413


async def test_unknown_ids_are_404(client: httpx.AsyncClient) -> None:
    assert (await client.get("/episodes/nope")).status_code == 404
    missing = await client.get("/batches/nope")
    assert missing.status_code == 404 and "nope" in missing.json()["detail"]


async def test_envs_and_health(client: httpx.AsyncClient) -> None:
    envs = (await client.get("/envs")).json()
    shop = next(env for env in envs if env["name"] == "builtin/shop")
    assert shop["splits"] == {"train": 200, "test": 50}
    assert not any(env["name"].startswith("tau-bench/") for env in envs if env["name"].startswith("builtin"))
    assert (await client.get("/health")).json() == {"status": "ok", "database": "ok"}
    ready = await client.get("/ready")
    assert ready.status_code == 200 and ready.json()["engine"] == "ok"


async def test_long_poll_returns_when_complete(client: httpx.AsyncClient) -> None:
    await client.post("/episodes", json=submission(batch_id="poll", task_indices=[3]))
    early = (await client.get("/batches/poll")).json()
    assert early["complete"] is False and early["episodes"] == []  # no group is whole yet
    loop = asyncio.get_running_loop()
    started = loop.time()
    batch = await wait_complete(client, "poll", seconds=30)
    assert loop.time() - started < 29
    assert len(batch["episodes"]) == 2


async def test_json_batch_with_tokens_matches_episodes(client: httpx.AsyncClient) -> None:
    await client.post("/episodes", json=submission(batch_id="tok", task_indices=[4]))
    await wait_complete(client, "tok")
    batch = (await client.get("/batches/tok", params={"include_tokens": "true"})).json()
    assert len(batch["episodes"]) == 2
    for entry in batch["episodes"]:
        episode = (await client.get(f"/episodes/{entry['id']}")).json()
        for key in ("prompt_ids", "response_ids", "loss_mask", "rollout_logprobs", "weight_versions"):
            assert entry[key] == episode[key]
        assert entry["response_length"] == len(episode["response_ids"])
    plain = (await client.get("/batches/tok")).json()
    assert "response_ids" not in plain["episodes"][0]


async def test_pause_and_continue_reach_every_worker(
    client: httpx.AsyncClient, sim: tuple[SimWorker, str]
) -> None:
    workers = (await client.get("/engine/workers")).json()["workers"]
    assert workers == [sim[1]]
    paused = await client.post("/engine/pause", json={"mode": "retract"})
    assert paused.status_code == 200 and paused.json()["workers"] == {sim[1]: "ok"}
    assert sim[0]._paused
    assert (await client.post("/engine/continue")).status_code == 200
    assert not sim[0]._paused
    assert (await client.post("/engine/pause", json={"mode": "sideways"})).status_code == 422


async def test_context_overflow_truncates_and_engine_refusal_fails(
    client: httpx.AsyncClient, sim: tuple[SimWorker, str]
) -> None:
    """A 400 for the context length ends the episode truncated; other 4xx fail it with SGLang's message."""
    huge = submission(batch_id="ctx", task_indices=[0], samples_per_task=1)
    huge["sampling_params"]["max_new_tokens"] = 40_000  # the sim's context is 32768
    await client.post("/episodes", json=huge)
    batch = await wait_complete(client, "ctx")
    episode = (await client.get(f"/episodes/{batch['episodes'][0]['id']}")).json()
    assert episode["status"] == "truncated"
    assert "context length" in episode["error"]
    assert episode["response_ids"] == [] and len(episode["prompt_ids"]) > 0

    sim[0].fail_next(1, status_code=400)
    await client.post("/episodes", json=submission(batch_id="bad", task_indices=[0], samples_per_task=1))
    failed = (await wait_complete(client, "bad"))["episodes"][0]
    assert failed["status"] == "failed" and "engine refused the request" in failed["error"]


async def test_an_engine_outage_requeues_the_episode_for_another_attempt(
    client: httpx.AsyncClient, sim: tuple[SimWorker, str]
) -> None:
    """Retries exhausted (e.g. a restarting engine): the episode runs again, not fails."""
    sim[0].fail_next(6, status_code=503)  # the client's 1 try + 5 retries of the first turn
    await client.post("/episodes", json=submission(batch_id="outage", task_indices=[5], samples_per_task=1))
    summary = (await wait_complete(client, "outage"))["episodes"][0]
    assert summary["attempt"] == 1 and summary["status"] != "failed", summary
    assert_stored_episode_matches_sim(sim[0], (await client.get(f"/episodes/{summary['id']}")).json())


async def test_liveness_answers_from_memory_while_the_database_hangs() -> None:
    # A "database" that takes connections into its backlog and never says a word.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        port = silent.getsockname()[1]
        settings = service_settings(f"postgresql+asyncpg://nobody@127.0.0.1:{port}/none", closed_port_url())
        app = create_app(settings.model_copy(update={"run_worker": False}))
        async with serve_app(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
            started = time.monotonic()
            health = await http.get("/health")
            assert time.monotonic() - started < 1.0  # no query behind it
            assert health.status_code == 200
            assert health.json() == {"status": "ok", "database": "error: TimeoutError: no answer within 5 s"}
            ready = await http.get("/ready")
            assert ready.status_code == 503 and "database error" in ready.json()["detail"]
