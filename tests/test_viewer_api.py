"""What the viewer reads: GET /batches (newest first, keyset pages), GET /batches/{id}/episodes (every
status), GET /episodes/{id}/tokens (tokens as text, where each call's tokens lie); and which pages
are public when API keys are set."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from service.app import create_app
from service.serving import serve_app
from service.sim.worker import SimWorker
from tests.conftest import service_settings
from tests.support.tokenizer import load_test_tokenizer
from tests.test_api import submission, wait_complete

SQLITE_ONLY = pytest.mark.parametrize("backend", ["sqlite"], indirect=True)


async def hold_generation(sim_url: str) -> None:
    async with httpx.AsyncClient(base_url=sim_url, timeout=60) as http:
        assert (await http.post("/pause_generation", json={"mode": "in_place"})).status_code == 200


async def run_batch(client: httpx.AsyncClient, batch_id: str, **overrides: Any) -> dict[str, Any]:
    body = submission(batch_id=batch_id, **overrides)
    assert (await client.post("/episodes", json=body)).status_code == 202
    return await wait_complete(client, batch_id)


async def test_batches_are_listed_newest_first_a_page_at_a_time(client: httpx.AsyncClient) -> None:
    finished = {}
    for batch_id in ("first", "second", "third"):
        finished[batch_id] = await run_batch(client, batch_id, task_indices=[0, 1], samples_per_task=2)

    page = (await client.get("/batches", params={"limit": 2})).json()
    assert [batch["batch_id"] for batch in page["batches"]] == ["third", "second"]
    assert page["next"] == "second"
    rest = (await client.get("/batches", params={"limit": 2, "before": page["next"]})).json()
    assert [batch["batch_id"] for batch in rest["batches"]] == ["first"]
    assert rest["next"] is None

    listed = page["batches"][0]
    episodes = finished["third"]["episodes"]
    rewards = [episode["reward"] for episode in episodes if episode["reward"] is not None]
    assert listed["total"] == 4 == sum(listed["counts"].values())
    assert listed["counts"] == finished["third"]["counts"]
    assert listed["reward_mean"] == pytest.approx(sum(rewards) / len(rewards))
    assert listed["env"] == "builtin/shop" and listed["metadata"] == {"step": 7}

    unknown = await client.get("/batches", params={"before": "no-such-batch"})
    assert unknown.status_code == 404 and "no-such-batch" in unknown.json()["detail"]
    assert (await client.get("/batches", params={"limit": 0})).status_code == 422


async def test_a_batch_lists_every_episode_whatever_its_status(
    client: httpx.AsyncClient, sim: tuple[SimWorker, str]
) -> None:
    """GET /batches/{id} shows complete groups only; the viewer's list shows the queued too."""
    done = await run_batch(client, "mixed", task_indices=[0], samples_per_task=2)
    await hold_generation(sim[1])  # the next batch stays queued and running
    assert (await client.post("/episodes", json=submission(batch_id="slow"))).status_code == 202

    everything = (await client.get("/batches/slow/episodes")).json()
    assert len(everything["episodes"]) == 6
    assert [(e["group_index"], e["sample_index"]) for e in everything["episodes"]] == [
        (group, sample) for group in range(3) for sample in range(2)
    ]
    assert {e["status"] for e in everything["episodes"]} <= {"queued", "running"}
    assert (await client.get("/batches/slow")).json()["episodes"] == []

    completed = (await client.get("/batches/mixed/episodes", params={"status": "completed"})).json()
    assert completed["episodes"] == [e for e in done["episodes"] if e["status"] == "completed"]
    none = await client.get("/batches/mixed/episodes", params=[("status", "failed"), ("status", "queued")])
    assert none.json()["episodes"] == []
    assert (await client.get("/batches/mixed/episodes", params={"status": "lost"})).status_code == 422
    assert (await client.get("/batches/nope/episodes")).status_code == 404
    await client.post("/batches/slow/cancel")


async def test_the_token_view_is_the_episodes_tokens_as_text(client: httpx.AsyncClient) -> None:
    batch = await run_batch(client, "tokens", task_indices=[0, 1], samples_per_task=1)
    tokenizer = load_test_tokenizer()
    for summary in batch["episodes"]:
        episode = (await client.get(f"/episodes/{summary['id']}")).json()
        view = (await client.get(f"/episodes/{summary['id']}/tokens")).json()

        assert view["response_ids"] == episode["response_ids"]
        assert view["loss_mask"] == episode["loss_mask"]
        assert view["rollout_logprobs"] == episode["rollout_logprobs"]
        assert view["response_tokens"] == [tokenizer.decode([token]) for token in episode["response_ids"]]
        assert view["prompt_text"] == tokenizer.decode(episode["prompt_ids"])
        # Each call's span starts and ends on its own sampled tokens, and they are all of them.
        mask = view["loss_mask"]
        assert len(view["turns"]) == len(episode["turns"])
        covered = 0
        for span, record in zip(view["turns"], episode["turns"], strict=True):
            assert (span["turn"], span["resume"], span["weight_version"]) == (
                record["turn"],
                record["resume"],
                record["weight_version"],
            )
            inside = mask[span["start"] : span["end"]]
            assert sum(inside) == record["output_tokens"]
            if record["output_tokens"]:
                assert inside[0] == 1 and inside[-1] == 1
            covered += sum(inside)
        assert covered == sum(mask)
        starts = [span["start"] for span in view["turns"]]
        assert starts == sorted(starts)

    assert (await client.get("/episodes/nope/tokens")).status_code == 404


@SQLITE_ONLY
async def test_unfinished_episodes_have_no_token_view(
    client: httpx.AsyncClient, sim: tuple[SimWorker, str]
) -> None:
    await hold_generation(sim[1])
    accepted = (await client.post("/episodes", json=submission(batch_id="waiting"))).json()
    response = await client.get(f"/episodes/{accepted['episode_ids'][0]}/tokens")
    assert response.status_code == 404 and "no tokens" in response.json()["detail"]
    await client.post("/batches/waiting/cancel")


@SQLITE_ONLY
async def test_with_api_keys_the_pages_are_public_and_the_data_is_not(
    database_url: str, sim: tuple[SimWorker, str]
) -> None:
    app = create_app(service_settings(database_url, sim[1], api_keys="k1", run_worker=False))
    async with serve_app(app) as url, httpx.AsyncClient(base_url=url, timeout=10) as http:
        for path in ("/ui/", "/ui/app.js", "/ui/app.css", "/docs", "/docs/assets/swagger-ui-bundle.js"):
            response = await http.get(path)
            assert response.status_code == 200, path
        assert (await http.get("/ui", follow_redirects=False)).status_code in (307, 308)
        assert (await http.get("/", follow_redirects=False)).headers["location"] == "/ui/"
        assert (await http.get("/openapi.json")).json()["paths"]["/batches"]
        for path in ("/batches", "/batches/x/episodes", "/episodes/x/tokens", "/ui/../batches"):
            assert (await http.get(path)).status_code in (401, 404), path
        assert (await http.get("/batches")).status_code == 401
        assert (await http.get("/batches", headers={"Authorization": "Bearer k1"})).status_code == 200


@SQLITE_ONLY
async def test_the_api_docs_load_nothing_from_outside(client: httpx.AsyncClient) -> None:
    page = (await client.get("/docs")).text
    assert "cdn" not in page.lower() and "https://" not in page
    assert "/docs/assets/swagger-ui-bundle.js" in page and "/docs/assets/swagger-ui.css" in page
    script = await client.get("/docs/assets/swagger-ui-bundle.js")
    assert script.status_code == 200 and "SwaggerUIBundle" in script.text
    assert (await client.get("/redoc")).status_code == 404  # ReDoc loads from a CDN: not served
