"""rollout_client against a live service on SQLite and PostgreSQL: what it pulls is what the service
stored, a retried submit makes no second copy, a wait outlives a service restart, and errors say
what went wrong."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pyarrow as pa
import pytest
from rollout_client import (
    AsyncRolloutClient,
    RequestError,
    RolloutClient,
    ServiceUnavailable,
    WaitTimeout,
)

from service.app import create_app
from service.serving import serve_app
from service.sim.worker import SimWorker
from service.storage.db import Database
from tests.conftest import service_settings
from tests.support.ports import free_port, refused_url
from tests.support.service_process import (
    episodes_of,
    service_process,
    simulated_sglang,
    submission,
    wait_for,
)

TASKS, SAMPLES = 3, 2


def fields(batch_id: str) -> dict[str, Any]:
    body = submission(batch_id, TASKS, SAMPLES)
    del body["env"], body["task_indices"], body["samples_per_task"]
    return body


async def assert_batch_is_what_was_stored(http: httpx.AsyncClient, batch: Any) -> None:
    assert len(batch) == TASKS * SAMPLES == batch.table.num_rows
    for episode in batch:
        stored = (await http.get(f"/episodes/{episode.episode_id}")).json()
        assert episode.prompt_ids.dtype == np.int32 and episode.response_ids.dtype == np.int32
        assert episode.loss_mask.dtype == np.uint8 and episode.rollout_logprobs.dtype == np.float64
        assert episode.prompt_ids.tolist() == stored["prompt_ids"]
        assert episode.response_ids.tolist() == stored["response_ids"]
        assert episode.loss_mask.tolist() == stored["loss_mask"]
        assert episode.rollout_logprobs.tolist() == stored["rollout_logprobs"]
        assert len(episode.response_ids) == len(episode.loss_mask) == len(episode.rollout_logprobs)
        assert (episode.status, episode.reward, episode.num_turns) == (
            stored["status"], stored["reward"], stored["num_turns"],
        )  # fmt: skip
        assert episode.weight_versions == stored["weight_versions"]
        assert episode.token_weight_versions == stored["token_weight_versions"]
        assert episode.messages == stored["messages"] and episode.info == stored["info"]
    groups = batch.groups()
    assert sorted(groups) == list(range(TASKS))
    assert all([e.sample_index for e in group] == list(range(SAMPLES)) for group in groups.values())
    np.testing.assert_array_equal(batch.reward, [np.nan if e.reward is None else e.reward for e in batch])


async def test_async_client_submits_waits_and_pulls_exact_arrays(client: httpx.AsyncClient) -> None:
    async with AsyncRolloutClient(str(client.base_url)) as rollouts:
        envs = await rollouts.envs()
        assert "builtin/shop" in {env["name"] for env in envs}
        submitted = await rollouts.submit(
            "builtin/shop", range(TASKS), samples_per_task=SAMPLES, **fields("a-1")
        )
        assert (
            submitted.batch_id == "a-1"
            and submitted.created
            and len(submitted.episode_ids) == TASKS * SAMPLES
        )
        summary = await rollouts.wait("a-1", timeout=60)
        assert summary["complete"] and summary["total"] == TASKS * SAMPLES
        batch = await rollouts.batch("a-1")
        await assert_batch_is_what_was_stored(client, batch)
        assert (await rollouts.batch_table("a-1")).num_rows == TASKS * SAMPLES
        episode = await rollouts.episode(submitted.episode_ids[0], wait=5)
        assert episode["id"] == submitted.episode_ids[0]


async def test_sync_client_submits_waits_and_pulls_exact_arrays(client: httpx.AsyncClient) -> None:
    def run() -> Any:
        with RolloutClient(str(client.base_url)) as rollouts:
            assert "builtin/shop" in {env["name"] for env in rollouts.envs()}
            # numpy integers, as a trainer holds task indices, go as JSON numbers
            submitted = rollouts.submit(
                "builtin/shop", np.arange(TASKS), samples_per_task=SAMPLES, task_split="test"
            )
            assert submitted.batch_id.startswith("b-")  # generated: every submit carries one
            rollouts.wait(submitted.batch_id, timeout=60)
            return rollouts.batch(submitted.batch_id)

    await assert_batch_is_what_was_stored(client, await asyncio.to_thread(run))


async def test_clients_follow_the_stream_of_complete_groups(client: httpx.AsyncClient) -> None:
    def follow() -> list[tuple[str, int]]:
        with RolloutClient(str(client.base_url)) as rollouts:
            rollouts.submit(
                "builtin/shop",
                list(range(TASKS)),
                samples_per_task=SAMPLES,
                task_split="test",
                batch_id="stream",
            )
            seen: list[tuple[str, int]] = []
            cursor = 0
            while len(seen) < TASKS:
                page = rollouts.groups(cursor, limit=2, wait=30, batch_id="stream")
                assert page.next > cursor and page.filtered == 0
                for key, episodes in page.groups().items():
                    assert [e.sample_index for e in episodes] == list(range(SAMPLES))
                    assert all(e.status not in ("queued", "running") for e in episodes)
                    seen.append(key)
                cursor = page.next
            return seen

    seen = await asyncio.to_thread(follow)
    assert sorted(seen) == [("stream", group) for group in range(TASKS)]
    async with AsyncRolloutClient(str(client.base_url)) as rollouts:
        everything = await rollouts.groups(0, limit=100)
        stored = (await client.get("/batches/stream")).json()
        assert len(everything.batch) == TASKS * SAMPLES
        assert everything.filtered == 0 and everything.next == TASKS
        kept = await rollouts.groups(0, limit=100, min_reward_std=0)
        assert kept.filtered == stored["groups_filtered"]
        assert len(kept.groups()) == TASKS - stored["groups_filtered"]


class LoseFirstAnswer(httpx.AsyncBaseTransport):
    """Forwards every request; the first POST /episodes reaches the service, but its answer is lost
    (as when a connection drops or a proxy times out after the server committed)."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.posts = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        if request.method == "POST" and request.url.path == "/episodes":
            self.posts += 1
            if self.posts == 1:
                await response.aclose()
                raise httpx.ReadError("connection reset after the request was sent", request=request)
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_a_retried_submit_gets_the_same_episodes(client: httpx.AsyncClient, db: Database) -> None:
    transport = LoseFirstAnswer()
    http = httpx.AsyncClient(base_url=str(client.base_url), transport=transport)
    async with AsyncRolloutClient(str(client.base_url), http=http, backoff=0.01) as rollouts:
        submitted = await rollouts.submit(
            "builtin/shop", range(TASKS), samples_per_task=SAMPLES, task_split="test"
        )
        assert transport.posts == 2 and not submitted.created  # the retry found the first one's batch
        again = await rollouts.submit(
            "builtin/shop",
            range(TASKS),
            samples_per_task=SAMPLES,
            task_split="test",
            batch_id=submitted.batch_id,
        )
        assert again.episode_ids == submitted.episode_ids
    stored = await episodes_of(db, submitted.batch_id)
    assert [episode.id for episode in stored] == submitted.episode_ids  # one copy, in order


async def test_errors_carry_the_service_message(client: httpx.AsyncClient) -> None:
    async with AsyncRolloutClient(str(client.base_url)) as rollouts:
        with pytest.raises(RequestError) as refused:
            await rollouts.submit("no/such-env", [0])
        assert refused.value.status_code == 422
        assert "env" in refused.value.message and "builtin/shop" in refused.value.message
        with pytest.raises(RequestError) as missing:
            await rollouts.summary("no-such-batch")
        assert missing.value.status_code == 404 and "no-such-batch" in str(missing.value)


async def test_retries_give_up_with_service_unavailable() -> None:
    with refused_url() as url:
        async with AsyncRolloutClient(url, retries=2, backoff=0.01) as rollouts:
            with pytest.raises(ServiceUnavailable, match="failed 3 times; last: ConnectError"):
                await rollouts.envs()


def test_a_wait_on_a_dead_service_ends_at_its_timeout() -> None:
    """The default retries would pause some 45 s in all: a wait's deadline cuts them short."""
    with refused_url() as url, RolloutClient(url) as rollouts:
        started = time.monotonic()
        with pytest.raises(WaitTimeout, match="last: ConnectError"):
            rollouts.wait("b-1", timeout=1.0)
        assert time.monotonic() - started < 3


def test_a_service_url_without_a_scheme_is_refused_at_once() -> None:
    with pytest.raises(ValueError, match="http://"):
        RolloutClient("127.0.0.1:8000")


def arrow_stream(rows: int) -> bytes:
    sink = pa.BufferOutputStream()
    table = pa.table({"x": list(range(rows))})
    with pa.ipc.new_stream(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=1):
            writer.write_batch(batch)
    return bytes(sink.getvalue().to_pybytes())


def test_5xx_and_a_cut_short_arrow_stream_are_retried_and_4xx_text_is_the_message() -> None:
    """A 503 is retried; so is an Arrow body that ends at a message boundary without the stream's
    end marker (the service failed mid-pull), which pyarrow would read as a shorter table."""
    whole = arrow_stream(4)
    answers = [
        httpx.Response(503, json={"detail": "database unavailable", "errors": []}),
        httpx.Response(200, content=whole[: whole.rindex(b"\xff\xff\xff\xff", 0, len(whole) - 8)]),
        httpx.Response(200, content=whole),
    ]
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path == "/batches/gone":
            return httpx.Response(410, text="gone for good")
        return answers[len(seen) - 1]

    http = httpx.Client(transport=httpx.MockTransport(handler))
    with RolloutClient("http://rollouts.test", "k1", http=http, backoff=0.01) as rollouts:
        assert rollouts.batch_table("b-1").column("x").to_pylist() == [0, 1, 2, 3]
        with pytest.raises(RequestError) as refused:
            rollouts.summary("gone")
    assert len(seen) == 4 and (refused.value.status_code, refused.value.message) == (410, "gone for good")
    # An httpx client passed in has no base URL and no key of its own: the client adds both.
    assert all(request.headers["authorization"] == "Bearer k1" for request in seen)
    assert str(seen[0].url) == "http://rollouts.test/batches/b-1"
    assert seen[0].headers["accept"] == "application/vnd.apache.arrow.stream"


async def test_api_key(database_url: str, sim: tuple[SimWorker, str]) -> None:
    app = create_app(service_settings(database_url, sim[1], api_keys="k1", run_worker=False))
    async with serve_app(app) as url:
        async with AsyncRolloutClient(url, "k1") as rollouts:
            assert "builtin/shop" in {env["name"] for env in await rollouts.envs()}
        async with AsyncRolloutClient(url, "wrong") as rollouts:
            with pytest.raises(RequestError) as refused:
                await rollouts.envs()
        assert refused.value.status_code == 401


async def test_cancel_and_wait_timeout(database_url: str, db: Database, tmp_path: Path) -> None:
    async with (
        simulated_sglang(latency_seconds=0.5) as (_, sglang_url),
        service_process(tmp_path, database_url, sglang_url, max_running_episodes=2) as service,
        AsyncRolloutClient(service.url) as rollouts,
    ):
        submitted = await rollouts.submit(
            "builtin/shop", range(TASKS), samples_per_task=SAMPLES, task_split="test"
        )
        with pytest.raises(WaitTimeout):
            await rollouts.wait(submitted.batch_id, timeout=0.5)
        cancelled = await rollouts.cancel(submitted.batch_id)
        assert cancelled["cancelled"] >= TASKS * SAMPLES - 2
        assert cancelled["counts"]["queued"] == cancelled["counts"]["running"] == 0
        summary = await rollouts.wait(submitted.batch_id, timeout=10)
        assert summary["counts"]["cancelled"] == cancelled["cancelled"]
        assert (await rollouts.cancel(submitted.batch_id))["cancelled"] == 0


async def test_wait_outlives_a_service_restart(database_url: str, db: Database, tmp_path: Path) -> None:
    """The service is killed mid-wait and started again on the same port and database: the
    client's wait keeps asking and returns the completed batch."""
    port = free_port()
    outcome: dict[str, Any] = {}
    async with simulated_sglang(latency_seconds=0.2) as (sim, sglang_url):
        async with service_process(tmp_path, database_url, sglang_url, "first", port=port) as first:
            rollouts = RolloutClient(first.url, backoff=0.2, max_backoff=1.0)
            submitted = rollouts.submit(
                "builtin/shop", list(range(TASKS)), samples_per_task=SAMPLES, task_split="test"
            )

            def wait() -> None:
                try:
                    outcome["summary"] = rollouts.wait(submitted.batch_id, timeout=90, poll=2)
                except Exception as error:
                    outcome["error"] = error

            waiter = threading.Thread(target=wait)
            waiter.start()
            await wait_for(lambda: _true(any(r.rid for r in sim.requests)), 20, "the first turn")
            first.kill()
        assert waiter.is_alive()  # still waiting through the outage
        async with service_process(tmp_path, database_url, sglang_url, "second", port=port):
            await asyncio.to_thread(waiter.join, 90)
        rollouts.close()
    assert "error" not in outcome, outcome.get("error")
    summary = outcome["summary"]
    assert summary["complete"] and summary["total"] == TASKS * SAMPLES
    assert summary["counts"]["failed"] == 0
    assert sorted(episode.id for episode in await episodes_of(db, submitted.batch_id)) == sorted(
        submitted.episode_ids
    )


async def _true(value: bool) -> bool:
    return value
