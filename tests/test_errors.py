"""Every failure answers the service's JSON error body: a database outage a 503 with Retry-After (retry,
not a bug), any other error a 500 (in a route or in middleware), an unreadable body a 400 saying why."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.types import ASGIApp, Receive, Scope, Send

from service.api.errors import RETRY_AFTER_SECONDS, field_path
from service.app import create_app
from service.serving import serve_app
from service.sim.worker import SimWorker
from tests.conftest import _drop_database, service_settings
from tests.support.openai_stub import closed_port_url

SUBMISSION = {"env": "builtin/shop", "task_split": "test", "task_indices": [0], "samples_per_task": 1}
# Everything that reads or writes the database, and the long-poll.
DATABASE_REQUESTS = [
    ("GET", "/batches/b-1"),
    ("GET", "/batches/b-1?wait=1"),
    ("GET", "/batches/b-1?include_tokens=true"),
    ("GET", "/episodes/e-1"),
    ("POST", "/episodes"),
    ("GET", "/metrics"),
]


def assert_error_body(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, (response.request.url, response.text)
    assert response.headers["content-type"] == "application/json", response.text
    body: dict[str, Any] = response.json()
    assert set(body) == {"detail", "errors"} and body["detail"], body
    return body


async def assert_database_unavailable(http: httpx.AsyncClient) -> None:
    for method, path in DATABASE_REQUESTS:
        response = await http.request(method, path, json=SUBMISSION if method == "POST" else None)
        body = assert_error_body(response, 503)
        assert response.headers["retry-after"] == str(RETRY_AFTER_SECONDS), path
        assert "database is unavailable" in body["detail"], (path, body)
    ready = await http.get("/ready")
    assert_error_body(ready, 503)
    assert ready.headers["retry-after"] == str(RETRY_AFTER_SECONDS)
    health = await http.get("/health")  # liveness answers from memory
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert (await http.get("/envs")).status_code == 200


@pytest.fixture
def unreachable_database_url(backend: str, tmp_path: Path) -> str:
    """PostgreSQL: a port nothing listens on (connections refused). SQLite: a file in a directory
    that does not exist (the file cannot be opened)."""
    if backend == "postgres":
        port = httpx.URL(closed_port_url()).port
        return f"postgresql+asyncpg://nobody@127.0.0.1:{port}/none"
    return f"sqlite+aiosqlite:///{tmp_path / 'missing' / 'rollouts.db'}"


async def test_an_unreachable_database_answers_503_with_retry_after(unreachable_database_url: str) -> None:
    settings = service_settings(unreachable_database_url, closed_port_url(), run_worker=False)
    async with serve_app(create_app(settings)) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        await assert_database_unavailable(http)


@pytest.mark.parametrize("backend", ["postgres"], indirect=True)
async def test_a_database_dropped_while_serving_answers_503(
    database_url: str, sim: tuple[SimWorker, str]
) -> None:
    """The server terminates the service's connections and the database is gone: its pooled
    connections break, new ones are refused."""
    settings = service_settings(database_url, sim[1], run_worker=False)
    async with serve_app(create_app(settings)) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        accepted = await http.post("/episodes", json=SUBMISSION | {"batch_id": "b-1"})
        assert accepted.status_code == 202, accepted.text
        assert (await http.get(f"/episodes/{accepted.json()['episode_ids'][0]}")).status_code == 200
        _drop_database(database_url.rsplit("/", 1)[1])
        await assert_database_unavailable(http)


class Explode:
    """An ASGI middleware that fails on one path, as a bug in middleware would."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == "/middleware-bug":
            raise RuntimeError("a bug in middleware")
        await self.app(scope, receive, send)


@pytest.fixture
async def buggy_app_url(database_url: str, sim: tuple[SimWorker, str]) -> AsyncIterator[str]:
    app = create_app(service_settings(database_url, sim[1], run_worker=False))

    async def route_bug() -> None:
        raise KeyError("a bug in a route")

    app.add_api_route("/route-bug", route_bug)
    app.add_middleware(Explode)
    async with serve_app(app) as url:
        yield url


async def test_other_errors_answer_500_with_the_error_body(buggy_app_url: str) -> None:
    async with httpx.AsyncClient(base_url=buggy_app_url, timeout=30) as http:
        for path in ("/route-bug", "/middleware-bug"):
            body = assert_error_body(await http.get(path), 500)
            assert "internal error" in body["detail"]
            assert "a bug" not in body["detail"]  # what failed is logged, not told


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)  # parsing happens before any storage
@pytest.mark.parametrize(
    ("content", "says"),
    [
        (b'{"env": "builtin/shop\xff"}', "not UTF-8: invalid start byte at byte 21"),
        (b"[" * 5000 + b"]" * 5000, "nested too deeply"),
        (b'{"task_indices": [' + b"9" * 5000 + b"]}", "not JSON: Exceeds the limit"),
    ],
    ids=["invalid-utf8", "5000-levels", "5000-digit-integer"],
)
async def test_an_unparseable_body_is_a_400_saying_why(
    client: httpx.AsyncClient, content: bytes, says: str
) -> None:
    response = await client.post("/episodes", content=content, headers={"content-type": "application/json"})
    body = assert_error_body(response, 400)
    assert says in body["detail"]
    assert body["errors"] == [{"loc": ["body"], "msg": body["detail"].removeprefix("request body "),
                               "type": "body_unparseable"}]  # fmt: skip


async def test_a_body_without_a_json_content_type_is_told_to_send_json(client: httpx.AsyncClient) -> None:
    content = b'{"env": "builtin/shop", "task_split": "test", "task_indices": [0]}'
    for headers in ({"content-type": "text/plain"}, {"content-type": "application/x-www-form-urlencoded"}):
        body = assert_error_body(await client.post("/episodes", content=content, headers=headers), 422)
        assert body["errors"][0]["loc"] == ["body"]
        assert (
            body["errors"][0]["msg"].startswith("send JSON: ") and headers["content-type"] in body["detail"]
        )


async def test_an_unknown_env_lists_every_known_one_external_included(client: httpx.AsyncClient) -> None:
    request = {"env": "nope", "task_split": "test", "task_indices": [0]}
    body = assert_error_body(await client.post("/episodes", json=request), 422)
    assert "unknown environment 'nope'" in body["detail"]
    assert "'external'" in body["detail"] and "'builtin/shop'" in body["detail"]


@pytest.mark.parametrize(
    ("location", "path"),
    [
        (["metadata", "foo", 2], "metadata.foo[2]"),
        (["sampling_params", "stop", 0], "sampling_params.stop[0]"),
        (["metadata", "a b", "x"], 'metadata["a b"].x'),
        (["metadata", "2"], 'metadata["2"]'),
        (["metadata", 'say "hi"'], 'metadata["say \\"hi\\""]'),
        (["metadata", "\ud800"], 'metadata["\\ud800"]'),
        ([], "body"),
    ],
)
def test_field_paths_are_unambiguous(location: list[str | int], path: str) -> None:
    assert field_path(location) == path
