"""The viewer in a real browser (headless Chromium through Playwright) against a live service holding
finished batches: each page loads and links to the next, the token view shows exactly the
episode's trained tokens, nothing shows without a key when keys are set, and the API docs render
with every outside address blocked. Screenshots of each page go to test-artifacts/screenshots."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlparse

import httpx
import pytest
from playwright.async_api import Page, Route
from sqlalchemy import update

from service.app import create_app
from service.serving import serve_app
from service.sim.worker import SimWorker
from service.storage.db import Database
from service.storage.models import Episode
from tests.conftest import service_settings
from tests.support.browser import PageErrors, chromium, require_chromium, screenshot
from tests.support.openai_stub import closed_port_url
from tests.support.stored import store_finished_batch
from tests.test_api import submission, wait_complete

pytestmark = pytest.mark.parametrize("backend", ["sqlite"], indirect=True)  # about pages, not storage
TIMEOUT_MS = 15_000


@pytest.fixture(autouse=True)
def _chromium() -> None:
    require_chromium()


@pytest.fixture
async def page() -> AsyncIterator[Page]:
    async with chromium() as browser:
        context = await browser.new_context(viewport={"width": 1280, "height": 900})
        context.set_default_timeout(TIMEOUT_MS)
        yield await context.new_page()


async def count(page: Page, selector: str) -> int:
    return await page.locator(selector).count()


async def test_every_page_loads_and_links_to_the_next(client: httpx.AsyncClient, page: Page) -> None:
    body = submission(batch_id="viewed", task_indices=[0, 1, 2], samples_per_task=2)
    assert (await client.post("/episodes", json=body)).status_code == 202
    batch = await wait_complete(client, "viewed")
    errors = PageErrors(page)
    base = str(client.base_url)

    await page.goto(f"{base}/ui/")
    await page.locator(".batch-row").first.wait_for()
    assert await count(page, ".batch-row") == 1
    assert "viewed" in await page.locator(".batch-row").inner_text()
    await screenshot(page, "batches")

    await page.get_by_role("link", name="viewed").click()
    await page.locator(".group-row").first.wait_for()
    assert await count(page, ".group-row") == 3
    assert await count(page, ".sample") == 6
    assert await count(page, "#histogram > div") > 0
    # Each status in the batch is named in the legend, with its symbol and what a trainer does with it;
    # each sample carries the symbol too, not only a colour.
    legend = await page.locator("#status-legend").inner_text()
    for status in {episode["status"] for episode in batch["episodes"]}:
        assert status in legend
    assert "trained on" in legend
    assert await count(page, ".sample .symbol") == 6
    await screenshot(page, "batch")

    statuses = {episode["status"] for episode in batch["episodes"]}
    status = sorted(statuses)[0]
    await page.locator(f'#status-filter [data-status="{status}"]').click()
    await page.wait_for_function("status => location.hash.includes('status=' + status)", arg=status)
    wanted = sum(episode["status"] == status for episode in batch["episodes"])
    await page.wait_for_function(f"document.querySelectorAll('.sample').length === {wanted}")
    assert await count(page, f".sample.{status}") == wanted

    # An episode the env ended, with its reward breakdown and a tool call: the simulated policy's turns
    # are random, and it ends some at the turn limit with neither (the first one, random-order seed
    # 1002, where the info panel had no reward_info).
    stored = [(await client.get(f"/episodes/{e['id']}")).json() for e in batch["episodes"]]
    episode = first = next(
        e
        for e in stored
        if "reward_info" in (e["info"] or {}) and any(m["role"] == "tool" for m in e["messages"])
    )
    await page.goto(f"{base}/ui/#/batches/viewed")
    await page.locator(f'a.sample[href="#/episodes/{first["id"]}"]').click()
    await page.locator("#transcript").wait_for()
    assert await count(page, "#transcript .msg") == len(episode["messages"])
    assert await count(page, "#transcript .msg.assistant .call") >= 1
    # The env's info (builtin/shop's reward breakdown) has a panel of its own, not only the raw JSON.
    panel = await page.locator("#info-panel").inner_text()
    assert "reward_info" in panel and "database_matches_ground_truth" in panel
    # Every tool result is shown with its tool's name (the one its call names, in the transcript).
    names = {
        call["id"]: call["function"]["name"]
        for message in episode["messages"]
        for call in message.get("tool_calls") or ()
    }
    results = [message for message in episode["messages"] if message["role"] == "tool"]
    assert results and all(names[message["tool_call_id"]] == message["name"] for message in results)
    shown = await page.locator("#transcript .msg.tool .role").all_inner_texts()
    assert [text.lower() for text in shown] == [f"tool {message['name']}".lower() for message in results]
    await screenshot(page, "episode-transcript")

    await page.locator("#tab-tokens").click()
    await page.locator("#tokens .t").first.wait_for()
    assert await count(page, "#tokens .m1") == sum(episode["loss_mask"])
    assert await count(page, "#tokens .m0") == len(episode["loss_mask"]) - sum(episode["loss_mask"])
    assert await count(page, "#tokens .mark") == len(episode["turns"])
    # The context after the last sampled turn (mask 0) says why it is there, where it starts.
    mask = episode["loss_mask"]
    last_sampled = max(index for index, value in enumerate(mask) if value)
    if last_sampled + 1 < len(mask):
        note = page.locator("#trailing-context")
        assert "mask 0, by design" in await note.inner_text()
        following = await note.evaluate("note => note.nextElementSibling.dataset.i")
        assert int(following) == last_sampled + 1
    await screenshot(page, "episode-tokens")

    await page.locator("#tab-timing").click()
    await page.locator("#timing").wait_for()
    assert await count(page, "#timing .bar") == len(episode["turns"])
    await screenshot(page, "episode-timing")
    assert await page.locator("#json-link").get_attribute("href") == f"/episodes/{first['id']}"

    await page.get_by_role("link", name="viewed").click()  # back up to the batch
    await page.locator(".group-row").first.wait_for()
    assert errors.messages == []


@pytest.fixture
async def api_only(database_url: str, db: Database) -> AsyncIterator[str]:
    """The API alone (no worker to claim what the tests store) on a free port."""
    app = create_app(service_settings(database_url, closed_port_url(), run_worker=False))
    async with serve_app(app) as url:
        yield url


async def test_big_batches_page_and_a_long_episode_shows_every_token(
    api_only: str, db: Database, page: Page
) -> None:
    batch_id, _ = await store_finished_batch(db, groups=250, samples=8, tokens=100, turns=2)
    _, (long_id,) = await store_finished_batch(db, groups=1, samples=1, tokens=30_400, turns=40, seed=1)
    errors = PageErrors(page)

    await page.goto(f"{api_only}/ui/#/batches/{batch_id}")
    await page.locator(".group-row").first.wait_for()
    assert await count(page, ".group-row") == 50  # a page of groups, not 250
    assert "page 1 of 5" in await page.locator(".pager").inner_text()
    await page.locator("#next").click()
    await page.wait_for_function("location.hash.includes('page=1')")
    assert await page.locator(".group-row").first.locator("td").first.inner_text() == "50"
    await screenshot(page, "batch-2000")

    async with httpx.AsyncClient(base_url=api_only, timeout=60) as http:
        episode = (await http.get(f"/episodes/{long_id}")).json()
    await page.goto(f"{api_only}/ui/#/episodes/{long_id}?tab=tokens")
    await page.locator("#tokens[data-render-ms]").wait_for()
    assert len(episode["response_ids"]) >= 30_000
    assert await count(page, "#tokens .m1") == sum(episode["loss_mask"])
    assert await count(page, "#tokens .m0") == len(episode["loss_mask"]) - sum(episode["loss_mask"])
    assert await count(page, "#tokens .mark") == 40
    await screenshot(page, "episode-30k-tokens", full_page=False)
    assert errors.messages == []


async def test_equal_rewards_and_an_engine_that_is_down_read_plainly(
    api_only: str, db: Database, page: Page
) -> None:
    batch_id, _ = await store_finished_batch(db, groups=2, samples=2, tokens=50, turns=2)
    async with db.sessionmaker.begin() as session:
        await session.execute(update(Episode).where(Episode.batch_id == batch_id).values(reward=1.0))
    errors = PageErrors(page)
    await page.goto(f"{api_only}/ui/#/batches/{batch_id}")
    await page.locator(".group-row").first.wait_for()
    assert await count(page, "#histogram > div") == 1  # one value, one bar
    axis = await page.locator(".histogram-axis").inner_text()
    assert "every one of the 4 rewards is 1.00" in axis and "0.50" not in axis
    assert await count(page, "#engine-waiting") == 0  # finished: nothing waits
    await screenshot(page, "batch-equal-rewards")

    # A batch whose episodes wait for an engine that does not answer (this service's engine URL
    # refuses connections) says so on its page.
    async with httpx.AsyncClient(base_url=api_only, timeout=60) as http:
        body = submission(batch_id="waiting", task_indices=[0], samples_per_task=2)
        assert (await http.post("/episodes", json=body)).status_code == 202
    await page.goto(f"{api_only}/ui/#/batches/waiting")
    waiting = page.locator("#engine-waiting")
    await waiting.wait_for()
    assert "waiting for the engine" in await waiting.inner_text()
    assert "queued" in await page.locator("#status-legend").inner_text()
    await screenshot(page, "batch-waiting-for-engine")
    assert errors.messages == []


@pytest.fixture
async def keyed(database_url: str, sim: tuple[SimWorker, str]) -> AsyncIterator[tuple[str, str]]:
    app = create_app(service_settings(database_url, sim[1], api_keys="secret-1"))
    async with serve_app(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        headers = {"Authorization": "Bearer secret-1"}
        body = submission(batch_id="private", task_indices=[0], samples_per_task=2)
        assert (await http.post("/episodes", json=body, headers=headers)).status_code == 202
        batch = (await http.get("/batches/private", params={"wait": 60}, headers=headers)).json()
        assert batch["complete"]
        yield url, batch["episodes"][0]["id"]


async def test_with_api_keys_nothing_shows_without_the_key(keyed: tuple[str, str], page: Page) -> None:
    url, episode_id = keyed
    answered: list[tuple[str, int]] = []
    page.on("response", lambda response: answered.append((urlparse(response.url).path, response.status)))

    for path in ("/ui/", "/ui/#/batches/private", f"/ui/#/episodes/{episode_id}?tab=tokens"):
        await page.goto(f"{url}{path}")
        await page.locator("#key-form").wait_for()
        assert await count(page, ".batch-row, .group-row, .sample, #transcript, #tokens") == 0
    await screenshot(page, "key-form")
    data = [(path, status) for path, status in answered if not path.startswith("/ui")]
    assert data and all(status == 401 for _, status in data), data

    await page.fill("#key-form input[name=key]", "wrong")
    await page.click("#key-form button")
    await page.get_by_text("That API key was refused.").wait_for()
    assert await count(page, "#tokens") == 0

    await page.fill("#key-form input[name=key]", "secret-1")
    await page.click("#key-form button")
    await page.locator("#tokens .t").first.wait_for()
    assert await page.evaluate("sessionStorage.getItem('rollout-api-key')") == "secret-1"
    await page.goto(f"{url}/ui/")
    await page.locator(".batch-row").first.wait_for()

    await page.click("#forget-key")
    await page.locator("#key-form").wait_for()
    assert await page.evaluate("sessionStorage.getItem('rollout-api-key')") is None


async def test_the_api_docs_render_offline(client: httpx.AsyncClient, page: Page) -> None:
    """Every request to anywhere but the service is cut, as on an offline training cluster."""
    base = urlparse(str(client.base_url))
    outside: list[str] = []

    async def offline(route: Route) -> None:
        target = urlparse(route.request.url)
        if (target.hostname, target.port) == (base.hostname, base.port):
            await route.continue_()
        else:
            outside.append(route.request.url)
            await route.abort()

    await page.route("**/*", offline)
    errors = PageErrors(page)
    await page.goto(f"{client.base_url}/docs")
    await page.locator(".opblock").first.wait_for()
    operations: dict[str, Any] = (await client.get("/openapi.json")).json()["paths"]
    assert await count(page, ".opblock") == sum(len(methods) for methods in operations.values())
    await screenshot(page, "api-docs")
    assert outside == [] and errors.messages == []


@pytest.fixture
async def two_projects(database_url: str, sim: tuple[SimWorker, str]) -> AsyncIterator[tuple[str, str]]:
    """team-a's batch and team-b's, each submitted with its project's key (API_PROJECTS)."""
    projects = {"team-a": {"keys": ["key-a"]}, "team-b": {"keys": ["key-b"]}}
    settings = service_settings(database_url, sim[1], api_keys="admin", api_projects=json.dumps(projects))
    async with serve_app(create_app(settings)) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        episode_b = ""
        for batch_id, key in (("team-a:mine", "key-a"), ("team-b:theirs", "key-b")):
            headers = {"Authorization": f"Bearer {key}"}
            body = submission(batch_id=batch_id, task_indices=[0], samples_per_task=2)
            assert (await http.post("/episodes", json=body, headers=headers)).status_code == 202
            batch = (await http.get(f"/batches/{batch_id}", params={"wait": 60}, headers=headers)).json()
            assert batch["complete"]
            episode_b = batch["episodes"][0]["id"]
        yield url, episode_b


async def test_a_project_key_sees_its_projects_batches_alone(
    two_projects: tuple[str, str], page: Page
) -> None:
    url, episode_b = two_projects
    await page.goto(f"{url}/ui/")
    await page.fill("#key-form input[name=key]", "key-a")
    await page.click("#key-form button")
    await page.locator(".batch-row").first.wait_for()
    rows = await page.locator(".batch-row").all_inner_texts()
    assert len(rows) == 1 and "team-a:mine" in rows[0] and "team-b" not in rows[0]
    await screenshot(page, "batches-of-a-project")
    # team-b's batch and episode, by their addresses: as if they did not exist.
    for path, said in (
        ("#/batches/team-b:theirs", "404: no batch 'team-b:theirs'"),
        (f"#/episodes/{episode_b}", f"404: no episode '{episode_b}'"),
    ):
        await page.goto(f"{url}/ui/{path}")
        await page.locator(".error-box").wait_for()
        assert await page.locator(".error-box").inner_text() == said
        assert await count(page, ".group-row, .sample, #transcript") == 0
