"""Scoped API keys (API_PROJECTS): a project key sees, lists, streams, pulls, cancels and submits
only its project's batches (ids starting with its prefix), and another project's batch or episode
is a 404 exactly like one that does not exist; admin keys (API_KEYS) see everything and alone
control the engine (403 for a project key). The operations checked come from the app's own OpenAPI
document: one added later is either scoped by its path's id and checked here, or must be placed in
UNSCOPED, or this file fails."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pyarrow as pa
import pytest
from pydantic import ValidationError

from service.app import create_app
from service.config import Settings
from service.serving import serve_app
from service.sim.worker import SimWorker
from tests.conftest import service_settings
from tests.support.service_process import wait_for
from tests.test_api import submission

ARROW = "application/vnd.apache.arrow.stream"
PROJECTS = {
    "team-a": {"keys": ["ka-1", "ka-2"]},  # batch_prefix: "team-a:" by default
    "team-b": {"keys": ["kb"], "batch_prefix": "b."},
}
ADMIN_KEY = "admin-key"
A, B, ADMIN = ({"Authorization": f"Bearer {key}"} for key in ("ka-2", "kb", ADMIN_KEY))
A_BATCH, B_BATCH, ADMIN_BATCH = "team-a:run", "b.run", "admin-run"
# An admin's batch whose id differs from team-a's prefix only in case: SQLite's LIKE would match it.
CASE_BATCH = "TEAM-A:run"
B_EXTERNAL = "b.agents"

# Every operation whose path names no batch or episode, and what a project key gets of it.
UNSCOPED = {
    "submit_episodes": "submit",  # its batch id: in the caller's prefix (test_submit_...)
    "list_batches": "list",
    "get_groups": "list",
    "engine_workers": "admin",
    "pause_generation": "admin",
    "continue_generation": "admin",
    "get_access": "open",
    "list_envs": "open",  # what may be submitted: every key's
    "get_model": "open",
    "health": "public",
    "health_head": "public",
    "ready": "public",
    "ready_head": "public",
    "metrics": "public",
}


@dataclass(frozen=True)
class Operation:
    method: str
    path: str
    operation_id: str
    scope: str  # "batch_id", "episode_id", or UNSCOPED's kind


def operations() -> list[Operation]:
    found = []
    for path, methods in create_app(Settings(api_keys=ADMIN_KEY)).openapi()["paths"].items():
        for method, operation in methods.items():
            named = [param["name"] for param in operation.get("parameters", []) if param["in"] == "path"]
            scope = named[0] if named else UNSCOPED.get(operation["operationId"], "unclassified")
            found.append(Operation(method.upper(), path, operation["operationId"], scope))
    return found


def by_scope(scope: str) -> list[Operation]:
    return [operation for operation in operations() if operation.scope == scope]


def ids(operations: list[Operation]) -> list[str]:
    return [operation.operation_id for operation in operations]


def test_every_operation_is_scoped_by_its_id_or_classified() -> None:
    found = operations()
    assert [o.operation_id for o in found if o.scope == "unclassified"] == []
    assert {o.scope for o in found if o.scope not in UNSCOPED.values()} == {"batch_id", "episode_id"}
    assert {o.operation_id for o in found if o.scope in UNSCOPED.values()} == set(UNSCOPED)
    # The checks below reach every batch and episode operation there is.
    assert len(by_scope("batch_id")) >= 3 and len(by_scope("episode_id")) >= 6


@dataclass
class World:
    http: httpx.AsyncClient
    episodes: dict[str, list[str]]  # batch id -> its episode ids


@pytest.fixture
async def world(database_url: str, sim: tuple[SimWorker, str]) -> AsyncIterator[World]:
    settings = service_settings(
        database_url, sim[1], api_keys=ADMIN_KEY, api_projects=json.dumps(PROJECTS), external_idle_seconds=600
    )
    async with serve_app(create_app(settings)) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        episodes = {}
        for batch_id, headers in ((A_BATCH, A), (B_BATCH, B), (ADMIN_BATCH, ADMIN), (CASE_BATCH, ADMIN)):
            body = submission(batch_id=batch_id, task_indices=[0, 1], samples_per_task=2)
            response = await http.post("/episodes", json=body, headers=headers)
            assert response.status_code == 202, response.text
            episodes[batch_id] = response.json()["episode_ids"]
        body = {"env": "external", "task_indices": [0], "batch_id": B_EXTERNAL}
        response = await http.post("/episodes", json=body, headers=B)
        assert response.status_code == 202, response.text
        episodes[B_EXTERNAL] = response.json()["episode_ids"]
        for batch_id in (A_BATCH, B_BATCH, ADMIN_BATCH, CASE_BATCH):
            done = await http.get(f"/batches/{batch_id}", params={"wait": 60}, headers=ADMIN)
            assert done.json()["complete"], done.text

        async def streamed() -> bool:
            """Every group in GET /groups: it is logged just after its batch completes, not with it."""
            response = await http.get("/groups", headers=ADMIN, params={"limit": 1000})
            return len(response.json()["groups"]) == 8

        await wait_for(streamed, 60, "the 4 batches' 8 groups in GET /groups")
        yield World(http, episodes)


def not_found(response: httpx.Response, what: str, id_: str) -> None:
    """The 404 of something that does not exist: nothing tells it exists elsewhere."""
    assert response.status_code == 404, (response.status_code, response.text)
    said = (f"no {what} {id_!r}", f"no external {what} {id_!r}", f"no {what} {id_!r} to page from (before=)")
    assert response.json()["detail"] in said


async def call(
    http: httpx.AsyncClient,
    operation: Operation,
    id_: str,
    headers: dict[str, str],
    *,
    params: dict[str, Any] | None = None,
    accept: str = "application/json",
) -> httpx.Response:
    path = operation.path.replace(f"{{{operation.scope}}}", id_)
    json_body = {} if operation.method == "POST" and operation.path.startswith("/v1/") else None
    return await http.request(
        operation.method, path, headers={**headers, "Accept": accept}, params=params, json=json_body
    )


# A long-poll asked of what a key cannot see ends at once: timed against half of this wait, not a
# fixed 2 s, and only where a wait was asked (a plain 404 once took 5.4 s on a loaded machine,
# random-order seed 1001).
LONG_POLL_SECONDS = 60


def answered_at_once(started: float, params: dict[str, Any]) -> bool:
    return "wait" not in params or time.monotonic() - started < LONG_POLL_SECONDS / 2


# What a batch operation is also asked with: the Arrow pull, the JSON token pull, a long-poll.
BATCH_VARIANTS: dict[str, list[dict[str, Any]]] = {
    "get_batch": [
        {"accept": ARROW},
        {"params": {"include_tokens": "true"}},
        {"params": {"wait": LONG_POLL_SECONDS}},
    ],
    "list_batch_episodes": [{"params": {"status": "completed"}}],
}


async def test_batch_operations_answer_only_the_keys_project(world: World) -> None:
    for operation in by_scope("batch_id"):
        for variant in [{}, *BATCH_VARIANTS.get(operation.operation_id, [])]:
            where = (operation.operation_id, variant)
            for foreign in (B_BATCH, ADMIN_BATCH, CASE_BATCH, "team-a", "team-a:absent"):
                started = time.monotonic()
                not_found(await call(world.http, operation, foreign, A, **variant), "batch", foreign)
                assert answered_at_once(started, variant.get("params", {})), where
            for headers in (B, ADMIN):
                not_found(
                    await call(world.http, operation, "b.absent", headers, **variant), "batch", "b.absent"
                )
            for batch_id, headers in ((A_BATCH, A), (B_BATCH, B), (A_BATCH, ADMIN), (B_BATCH, ADMIN)):
                response = await call(world.http, operation, batch_id, headers, **variant)
                assert response.status_code == 200, (where, batch_id, response.text)
                if variant.get("accept") == ARROW:
                    table = pa.ipc.open_stream(response.content).read_all()
                    assert set(table.column("batch_id").to_pylist()) == {batch_id}
                else:
                    assert response.json()["batch_id"] == batch_id, where


async def test_episode_operations_answer_only_the_keys_project(world: World) -> None:
    a_episode, b_episode = world.episodes[A_BATCH][0], world.episodes[B_BATCH][0]
    admin_episode = world.episodes[ADMIN_BATCH][0]
    for operation in by_scope("episode_id"):
        agent = operation.path.startswith("/v1/")
        own, foreign = (world.episodes[B_EXTERNAL][0], a_episode) if agent else (a_episode, b_episode)
        # An agent's endpoints serve external episodes (team-b's here): team-a's key is the foreign one.
        owner, stranger = (B, A) if agent else (A, B)
        for episode_id, headers in ((foreign, owner), (admin_episode, owner), ("absent", owner)):
            for params in (
                {},
                {"wait": LONG_POLL_SECONDS} if operation.operation_id == "get_episode" else {},
            ):
                started = time.monotonic()
                response = await call(world.http, operation, episode_id, headers, params=params)
                not_found(response, "episode", episode_id)
                assert answered_at_once(started, params), operation.operation_id
        not_found(await call(world.http, operation, own, stranger), "episode", own)
        for headers in (owner, ADMIN):
            response = await call(world.http, operation, own, headers)
            if agent:  # the key opens it: an empty call is refused (422), an empty finish ends it (200, 409)
                assert response.status_code in (200, 409, 422), (operation.operation_id, response.text)
            else:
                assert response.status_code == 200, (operation.operation_id, response.text)
                assert response.json().get("id", own) == own


async def test_lists_show_the_keys_project_alone(world: World) -> None:
    async def listed(headers: dict[str, str], **params: Any) -> list[str]:
        response = await world.http.get("/batches", headers=headers, params=params)
        assert response.status_code == 200, response.text
        return [batch["batch_id"] for batch in response.json()["batches"]]

    assert await listed(A) == [A_BATCH]
    assert sorted(await listed(B)) == sorted([B_BATCH, B_EXTERNAL])
    assert sorted(await listed(ADMIN)) == sorted(world.episodes)
    # Paging: one at a time reaches the same, and a cursor from outside the scope is unknown.
    first = (await world.http.get("/batches", headers=B, params={"limit": 1})).json()
    second = await listed(B, before=first["next"])
    assert sorted([first["batches"][0]["batch_id"], *second]) == sorted([B_BATCH, B_EXTERNAL])
    for cursor in (A_BATCH, ADMIN_BATCH):
        not_found(await world.http.get("/batches", headers=B, params={"before": cursor}), "batch", cursor)

    async def group_batches(headers: dict[str, str], **params: Any) -> tuple[list[str], int]:
        response = await world.http.get("/groups", headers=headers, params={"limit": 1000, **params})
        assert response.status_code == 200, response.text
        page = response.json()
        return [group["batch_id"] for group in page["groups"]], page["filtered"]

    assert await group_batches(A) == ([A_BATCH] * 2, 0)
    assert await group_batches(B) == ([B_BATCH] * 2, 0)
    everyone, _ = await group_batches(ADMIN)
    assert sorted(everyone) == sorted([A_BATCH, B_BATCH, ADMIN_BATCH, CASE_BATCH] * 2)
    assert await group_batches(A, batch_id=[B_BATCH, ADMIN_BATCH]) == ([], 0)  # named: still not shown
    # A filter counts what it skipped of the key's own groups, none of the others'.
    kept, filtered = await group_batches(A, min_reward_std=1e9)
    assert (kept, filtered) == ([], 2)
    arrow = await world.http.get("/groups", headers={**A, "Accept": ARROW}, params={"limit": 1000})
    table = pa.ipc.open_stream(arrow.content).read_all()
    assert table.num_rows == 4 and set(table.column("batch_id").to_pylist()) == {A_BATCH}


async def test_submitting_outside_the_prefix_is_refused_and_generated_ids_take_it(world: World) -> None:
    for batch_id in (B_BATCH, "b.new", "team-a", "TEAM-A:new", "other"):
        body = submission(batch_id=batch_id, task_indices=[0], samples_per_task=1)
        response = await world.http.post("/episodes", json=body, headers=A)
        assert response.status_code == 422, response.text
        error = response.json()
        assert error["errors"][0]["loc"] == ["body", "batch_id"]
        assert "'team-a:'" in error["detail"] and "GET /access" in error["detail"]
    body = submission(task_indices=[0], samples_per_task=1)  # no batch_id
    generated = await world.http.post("/episodes", json=body, headers=B)
    assert generated.status_code == 202 and re.fullmatch(r"b\.[0-9a-f]{32}", generated.json()["batch_id"])
    admin = await world.http.post("/episodes", json={**body, "batch_id": "b.by-admin"}, headers=ADMIN)
    assert admin.status_code == 202  # an admin submits anywhere
    again = submission(batch_id="team-a:second", task_indices=[0], samples_per_task=1)
    assert (await world.http.post("/episodes", json=again, headers=A)).status_code == 202


async def test_engine_controls_are_an_admins(world: World) -> None:
    admin_only = [operation for operation in operations() if operation.scope == "admin"]
    assert ids(admin_only) == ["engine_workers", "pause_generation", "continue_generation"]
    for operation in admin_only:
        for headers in (A, B):
            response = await world.http.request(operation.method, operation.path, headers=headers, json={})
            assert response.status_code == 403, response.text
            assert "admin key" in response.json()["detail"]
    assert (await world.http.get("/engine/workers", headers=ADMIN)).status_code == 200
    for operation in by_scope("open"):
        assert (await world.http.request(operation.method, operation.path, headers=A)).status_code == 200


async def test_access_tells_a_key_its_scope(world: World) -> None:
    answers = [(await world.http.get("/access", headers=headers)).json() for headers in (A, B, ADMIN)]
    assert answers == [
        {"admin": False, "project": "team-a", "batch_prefix": "team-a:"},
        {"admin": False, "project": "team-b", "batch_prefix": "b."},
        {"admin": True, "project": None, "batch_prefix": ""},
    ]
    assert (await world.http.get("/access")).status_code == 401
    assert (await world.http.get("/access", headers={"Authorization": "Bearer ka"})).status_code == 401


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
async def test_project_keys_alone_still_close_the_service(
    database_url: str, sim: tuple[SimWorker, str]
) -> None:
    """API_PROJECTS without API_KEYS: no admin key, and no request without a key either."""
    settings = service_settings(database_url, sim[1], api_keys="", api_projects=json.dumps(PROJECTS))
    async with serve_app(create_app(settings)) as url, httpx.AsyncClient(base_url=url, timeout=60) as http:
        for path in ("/batches", "/groups", "/access", "/engine/workers"):
            assert (await http.get(path)).status_code == 401, path
        assert (await http.get("/access", headers=A)).json()["project"] == "team-a"
        assert (await http.get("/engine/workers", headers=A)).status_code == 403


@pytest.mark.parametrize(
    ("projects", "message"),
    [
        (
            '{"a": {"keys": ["k1"]}, "b": {"keys": ["k1"]}}',
            "project 'b': one of its keys is also a key of project 'a'",
        ),
        ('{"a": {"keys": ["admin-key"]}}', "project 'a': one of its keys is also a key of API_KEYS"),
        (
            '{"a": {"keys": ["k1"], "batch_prefix": "x"}, "b": {"keys": ["k2"], "batch_prefix": "xy"}}',
            "overlap",
        ),
        (
            '{"a": {"keys": ["k1"], "batch_prefix": "x:"}, "b": {"keys": ["k2"], "batch_prefix": "x:"}}',
            "overlap",
        ),
        ('{"a": {"keys": ["k1"], "batch_prefix": ""}}', "a.batch_prefix: String should have at least 1"),
        ('{"a": {"keys": ["k1"], "batch_prefix": "a/"}}', "a.batch_prefix: String should match pattern"),
        ('{"a b": {"keys": ["k1"]}}', "its default batch_prefix 'a b:' is not the start of a batch id"),
        ('{"a": {"keys": []}}', "a.keys: List should have at least 1 item"),
        ('{"a": {"keys": ["k 1"]}}', "a key is empty, or holds whitespace or non-ASCII"),
        ('{"a": {"keys": ["k\\t1"]}}', "a key is empty, or holds whitespace or non-ASCII"),
        ('{"a": {"keys": ["k\u00e91"]}}', "a key is empty, or holds whitespace or non-ASCII"),
        ('{"a": {"keys": [""]}}', "a key is empty, or holds whitespace or non-ASCII"),
        ('{"a": {"keys": ["k1"], "prefix": "a:"}}', "a.prefix: Extra inputs are not permitted"),
        ('["k1"]', "Input should be an object"),
        ("k1,k2", "Invalid JSON"),
    ],
)
def test_a_wrong_api_projects_is_refused_at_start(projects: str, message: str) -> None:
    with pytest.raises(ValidationError) as raised:
        Settings(api_keys=ADMIN_KEY, api_projects=projects)
    assert message in str(raised.value)
    assert "k1" not in str(raised.value) and ADMIN_KEY not in str(raised.value)  # no key is repeated


def test_the_command_line_names_the_setting(tmp_path: Path) -> None:
    env = {"API_KEYS": "k1", "API_PROJECTS": '{"a": {"keys": ["k1"]}}', "PATH": "/usr/bin:/bin"}
    result = subprocess.run(
        [sys.executable, "-m", "service", "migrate"],
        cwd=tmp_path,
        env={**env, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert (
        result.stderr.strip() == "error: API_PROJECTS: project 'a': one of its keys is also a key of API_KEYS"
    )


async def test_the_client_makes_its_batch_ids_in_the_keys_scope(world: World) -> None:
    """rollout_client asks GET /access once, and the ids it makes (generated, or from a trainer's
    parts, as the adapters make theirs) start with the key's prefix; an admin's are unchanged."""
    from rollout_client import AsyncRolloutClient

    url = str(world.http.base_url)
    async with AsyncRolloutClient(url, "ka-1") as client:
        assert (await client.access()).batch_prefix == "team-a:"
        made = await client.batch_id("run 1", "train", 3)
        assert made == "team-a:run_1-train-3"
        submitted = await client.submit("builtin/shop", [0], task_split="test", batch_id=made)
        generated = await client.submit("builtin/shop", [0], task_split="test")
        assert submitted.batch_id == made and generated.batch_id.startswith("team-a:b-")
        assert (await client.summary(made))["batch_id"] == made
    async with AsyncRolloutClient(url, ADMIN_KEY) as client:
        assert await client.batch_id("run 1", "train", 3) == "run_1-train-3"
