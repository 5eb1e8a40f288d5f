"""API keys: every endpoint but the probes and the scrape (/health, /ready, /metrics) and the pages
(the viewer, the API docs and their contract, tests/test_viewer_api.py) needs
`Authorization: Bearer <one of API_KEYS>`; without keys the service runs open and says so in its
start-up log."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import httpx
import pytest

from service.app import create_app
from service.serving import serve_app
from service.sim.worker import SimWorker
from tests.conftest import service_settings

SQLITE_ONLY = pytest.mark.parametrize("backend", ["sqlite"], indirect=True)  # auth is not about storage
KEYS = ("k1", "k2")
SUBMISSION = {
    "env": "builtin/shop",
    "task_split": "test",
    "task_indices": [0],
    "samples_per_task": 1,
    "batch_id": "auth",
}
OPEN_WARNING = "API_KEYS is not set"


@pytest.fixture
async def keyed_url(database_url: str, sim: tuple[SimWorker, str]) -> AsyncIterator[str]:
    app = create_app(service_settings(database_url, sim[1], api_keys=",".join(KEYS), run_worker=False))
    async with serve_app(app) as url:
        yield url


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def protected_requests(http: httpx.AsyncClient, headers: dict[str, str]) -> dict[str, httpx.Response]:
    """One request of each protected endpoint (the submission first, so the GETs find its ids)."""
    submitted = await http.post("/episodes", json=SUBMISSION, headers=headers)
    episode_id = submitted.json()["episode_ids"][0] if submitted.status_code == 202 else "unknown"
    responses = {"POST /episodes": submitted}
    for path in (
        f"/episodes/{episode_id}",
        "/batches/auth",
        "/envs",
        "/batches",
        "/batches/auth/episodes",
        "/groups",
    ):
        responses[f"GET {path.replace(episode_id, '{id}')}"] = await http.get(path, headers=headers)
    return responses


@SQLITE_ONLY
@pytest.mark.parametrize(
    "headers",
    [
        {},
        bearer("wrong"),
        {"Authorization": "Bearer"},
        bearer("k"),
        bearer("k11"),
        bearer("k1,k2"),
        {"Authorization": "k1"},  # no scheme
        {"Authorization": "Basic k1"},
        {"X-API-Key": "k1"},
    ],
    ids=[
        "none",
        "wrong",
        "no-key",
        "prefix",
        "longer",
        "both-keys-joined",
        "no-scheme",
        "basic",
        "other-header",
    ],
)
async def test_protected_endpoints_refuse_a_missing_or_wrong_key(
    keyed_url: str, headers: dict[str, str]
) -> None:
    async with httpx.AsyncClient(base_url=keyed_url, timeout=10) as http:
        responses = await protected_requests(http, headers)
        # A kubelet's probes and a Prometheus scrape send no key (or whatever they were given).
        for path in ("/health", "/ready"):
            assert (await http.get(path, headers=headers)).status_code == 200, path
            assert (await http.head(path, headers=headers)).status_code == 200, path
        scrape = await http.get("/metrics", headers=headers)
        assert scrape.status_code == 200 and "rollout_episodes_outstanding 0.0" in scrape.text
        responses["GET /episodes/{id}/tokens"] = await http.get("/episodes/x/tokens", headers=headers)
    for name, response in responses.items():
        assert response.status_code == 401, (name, response.status_code, response.text)
        assert response.headers["www-authenticate"] == "Bearer", name
        assert "API key" in response.json()["detail"], name


@SQLITE_ONLY
@pytest.mark.parametrize("key", KEYS)
async def test_either_key_opens_every_endpoint(keyed_url: str, key: str) -> None:
    async with httpx.AsyncClient(base_url=keyed_url, timeout=10) as http:
        responses = await protected_requests(http, bearer(key))
        assert (await http.get("/health")).status_code == 200  # with no key at all
        # The episode just submitted waits (no worker here): the autoscaler's metric counts it.
        assert "rollout_episodes_outstanding 1.0" in (await http.get("/metrics")).text
    assert responses.pop("POST /episodes").status_code == 202
    for name, response in responses.items():
        assert response.status_code == 200, (name, response.status_code, response.text)
    # The scheme is case-insensitive (RFC 7235).
    async with httpx.AsyncClient(base_url=keyed_url, timeout=10) as http:
        assert (await http.get("/envs", headers={"Authorization": f"bearer {key}"})).status_code == 200


@SQLITE_ONLY
async def test_start_up_warns_when_api_keys_are_unset(
    database_url: str, sim: tuple[SimWorker, str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="service.app")
    async with serve_app(
        create_app(service_settings(database_url, sim[1], api_keys="", run_worker=False))
    ) as url:
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            assert (await http.get("/envs")).status_code == 200  # open
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and OPEN_WARNING in r.getMessage()]
    assert len(warnings) == 1

    caplog.clear()
    async with serve_app(create_app(service_settings(database_url, sim[1], api_keys="k1", run_worker=False))):
        pass
    assert not any(OPEN_WARNING in r.getMessage() for r in caplog.records)


@SQLITE_ONLY
async def test_the_key_is_checked_before_the_body_size(keyed_url: str) -> None:
    too_large = b"{" + b" " * 2_000_000 + b"}"
    headers = {"content-type": "application/json"}
    async with httpx.AsyncClient(base_url=keyed_url, timeout=10) as http:
        anonymous = await http.post("/episodes", content=too_large, headers=headers)
        keyed = await http.post("/episodes", content=too_large, headers=headers | bearer("k2"))
    assert anonymous.status_code == 401
    assert keyed.status_code == 413 and "larger than" in keyed.json()["detail"]
