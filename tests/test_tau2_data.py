"""tau2-bench's data folder as the service reads it (no tau2 import, so these run without tau2):
split sizes, splits that lack a data file named exactly, tasks that need an LLM judge; and what
GET /envs and POST /episodes say of them."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from service import app as app_module
from service.app import create_app
from service.envs import registry, tau2_data
from service.envs.base import EnvSpec, UserSimConfig
from service.serving import serve_app
from tests.conftest import service_settings


def task(task_id: str, *, judged: bool = False) -> dict[str, Any]:
    basis = ["DB", "NL_ASSERTION"] if judged else ["DB"]
    return {
        "id": task_id,
        "user_scenario": {"instructions": "help me"},
        "evaluation_criteria": {
            "actions": [],
            "reward_basis": basis,
            "nl_assertions": ["polite"] if judged else [],
        },
    }


def write(path: Path, content: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content if isinstance(content, str) else json.dumps(content))


@pytest.fixture
def data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A tau2 data folder as a snapshot of the repository can leave it: retail whole, airline without
    db.json, telecom without tasks.json (its `small` split has a file of its own), mock without its
    split file."""
    root = tmp_path / "data"
    for name in tau2_data.USER_SIMULATOR_FILES:
        write(root / name, "guidelines")
    domains = root / "tau2" / "domains"
    write(domains / "retail" / "db.json", {})
    write(domains / "retail" / "policy.md", "policy")
    write(
        domains / "retail" / "tasks.json",
        [task("0"), task("1", judged=True), task("2"), task("3", judged=True)],
    )
    write(domains / "retail" / "split_tasks.json", {"train": ["3", "0", "1"], "test": ["2"]})
    write(domains / "airline" / "policy.md", "policy")
    write(domains / "airline" / "tasks.json", [task("0")])
    write(domains / "airline" / "split_tasks.json", {"test": ["0"]})
    for name in tau2_data.DOMAIN_FILES["telecom"]:
        write(domains / "telecom" / name, "x")
    write(domains / "telecom" / "tasks_small.json", [task("[a]b"), task("[a]c")])
    write(domains / "telecom" / "split_tasks.json", {"small": ["[a]c", "[a]b"], "train": ["[x]y"]})
    write(domains / "mock" / "tasks.json", [task("m")])
    monkeypatch.setenv("TAU2_DATA_DIR", str(root))
    return root


def test_splits_in_their_files_order_and_what_each_lacks(data_dir: Path) -> None:
    retail = tau2_data.read_domain(data_dir, "retail")
    assert retail.splits == {"train": ["3", "0", "1"], "test": ["2"]}
    assert retail.unavailable == {}
    assert retail.judged == {"train": frozenset({0, 2}), "test": frozenset()}  # indexes in the split

    airline = tau2_data.read_domain(data_dir, "airline")
    missing_db = str(data_dir / "tau2" / "domains" / "airline" / "db.json")
    assert set(airline.unavailable) == {"test"} and missing_db in airline.unavailable["test"]

    telecom = tau2_data.read_domain(data_dir, "telecom")
    assert {split: len(ids) for split, ids in telecom.splits.items()} == {"small": 2, "train": 1}
    assert "small" not in telecom.unavailable
    assert str(data_dir / "tau2" / "domains" / "telecom" / "tasks.json") in telecom.unavailable["train"]

    mock = tau2_data.read_domain(data_dir, "mock")
    assert "split_tasks.json" in mock.unavailable["*"]


def test_tasks_are_read_in_their_split_order(data_dir: Path) -> None:
    assert [task["id"] for task in tau2_data.read_tasks(data_dir, "retail", "train")] == ["3", "0", "1"]
    assert [task["id"] for task in tau2_data.read_tasks(data_dir, "telecom", "small")] == ["[a]c", "[a]b"]
    with pytest.raises(ValueError, match=r"airline/db\.json is missing"):
        tau2_data.read_tasks(data_dir, "airline", "test")
    with pytest.raises(ValueError, match="no split 'dev'"):
        tau2_data.read_tasks(data_dir, "retail", "dev")


def test_a_missing_user_simulator_prompt_stops_every_split(data_dir: Path) -> None:
    (data_dir / tau2_data.USER_SIMULATOR_FILES[1]).unlink()
    retail = tau2_data.read_domain(data_dir, "retail")
    assert set(retail.unavailable) == {"train", "test"}
    assert "simulation_guidelines_tools.md" in retail.unavailable["train"]


def test_data_dir_is_tau2_data_dir(data_dir: Path) -> None:
    assert tau2_data.data_dir() == data_dir


@pytest.fixture
async def client(
    data_dir: Path, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[httpx.AsyncClient]:
    """The service with the tau2 domains of `data_dir` (tau2 itself need not be installed: nothing
    here runs an episode)."""

    def envs() -> dict[str, EnvSpec]:
        specs = registry.builtin_envs() + registry.tau2_envs()
        return {spec.name: spec for spec in specs}

    monkeypatch.setattr(app_module, "available_envs", envs)
    app = create_app(service_settings(database_url, "http://127.0.0.1:9", run_worker=False))
    async with serve_app(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        yield http


async def test_envs_lists_every_split_and_why_some_cannot_run(
    client: httpx.AsyncClient, data_dir: Path
) -> None:
    envs = {env["name"]: env for env in (await client.get("/envs")).json()}
    assert envs["tau2/retail"]["splits"] == {"train": 3, "test": 1}
    assert envs["tau2/retail"]["unavailable"] == {}
    assert envs["tau2/retail"]["judged_tasks"] == {"train": 2}
    assert "airline/db.json is missing" in envs["tau2/airline"]["unavailable"]["test"]
    assert envs["tau2/telecom"]["splits"] == {"small": 2, "train": 1}
    assert list(envs["tau2/telecom"]["unavailable"]) == ["train"]
    assert envs["builtin/shop"]["unavailable"] == {}


async def submit(client: httpx.AsyncClient, env: str, split: str, tasks: list[int]) -> httpx.Response:
    body = {"env": env, "task_split": split, "task_indices": tasks, "samples_per_task": 2}
    return await client.post("/episodes", json=body)


async def test_a_split_without_its_data_is_refused_naming_the_file(
    client: httpx.AsyncClient, data_dir: Path
) -> None:
    response = await submit(client, "tau2/airline", "test", [0])
    assert response.status_code == 422
    assert response.json()["errors"][0]["loc"] == ["body", "task_split"]
    assert str(data_dir / "tau2" / "domains" / "airline" / "db.json") in response.json()["detail"]

    response = await submit(client, "tau2/telecom", "train", [0])
    assert response.status_code == 422
    assert str(data_dir / "tau2" / "domains" / "telecom" / "tasks.json") in response.json()["detail"]

    response = await submit(client, "tau2/mock", "base", [0])
    assert response.status_code == 422
    assert response.json()["errors"][0]["loc"] == ["body", "env"]
    assert "split_tasks.json is missing" in response.json()["detail"]

    assert (await submit(client, "tau2/telecom", "small", [0, 1])).status_code == 202


async def test_judged_tasks_need_a_judge(client: httpx.AsyncClient) -> None:
    response = await submit(client, "tau2/retail", "train", [1, 2])
    assert response.status_code == 422
    error = response.json()["errors"][0]
    assert error["loc"] == ["body", "task_indices", 1]
    assert "JUDGE_BASE_URL" in error["msg"] and "NL_ASSERTION" in error["msg"]
    assert (await submit(client, "tau2/retail", "train", [1])).status_code == 202  # index 1 is task "0"


async def test_with_a_judge_they_are_taken(
    data_dir: Path, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        app_module, "available_envs", lambda: {spec.name: spec for spec in registry.tau2_envs()}
    )
    settings = service_settings(
        database_url,
        "http://127.0.0.1:9",
        run_worker=False,
        user_sim=UserSimConfig(judge_base_url="http://judge/v1", judge_model="j"),
    )
    async with serve_app(create_app(settings)) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        assert (await submit(http, "tau2/retail", "train", [0, 2])).status_code == 202
