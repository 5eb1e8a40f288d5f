"""Database fixtures: every test gets its own fresh database, on SQLite and on PostgreSQL.

Fixtures
- `backend`: "sqlite" or "postgres". Any test using the fixtures below runs once per backend. To
  run on one backend only: `@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)`.
- `database_url`: the async SQLAlchemy URL of a new database migrated to head, private to the test
  and removed after it. For app tests: `create_app(Settings(database_url=database_url))`.
- `db`: a `service.storage.db.Database` on that database: `.url`, `.engine` (from `make_engine`,
  disposed after the test) and `.sessionmaker`. A second engine on
  the same database (a "second process"): `make_engine(db.url, connect_timeout=CONNECT_TIMEOUT_SECONDS)`
  (tests/support/settings.py); dispose it yourself.
- `empty_database_url`: like `database_url` but not migrated (for migration tests).

SQLite databases are files in `tmp_path`, copied from one migrated per session. PostgreSQL ones are
`CREATE DATABASE ... TEMPLATE` of a template migrated per session, dropped after the test. The
server is ROLLOUT_TEST_POSTGRES_URL (default postgresql://postgres@127.0.0.1:5432/postgres, a user
who may CREATE DATABASE). If it is unreachable the postgres tests fail, unless ROLLOUT_SKIP_POSTGRES=1,
which skips them instead. `-m "not postgres"` deselects them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import os
import shutil
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import asyncpg
import httpx
import pytest
from _pytest.nodeid import NodeId
from sqlalchemy.engine import make_url

from service.app import create_app
from service.config import Settings
from service.serving import serve_app
from service.sim.worker import SimConfig, SimWorker, create_sim_app, serve_in_thread
from service.storage.db import Database, run_migrations
from tests.support.agents import weather_policy
from tests.support.remote_servers import GUESS_SERVER, OpenEnvServers, launch_server, listening
from tests.support.settings import CONNECT_TIMEOUT_SECONDS, TEST_SETTINGS

POSTGRES_ADMIN_URL = os.environ.get(
    "ROLLOUT_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
)
SKIP_POSTGRES = os.environ.get("ROLLOUT_SKIP_POSTGRES") == "1"
BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]

T = TypeVar("T")

# Hypothesis' timing checks judge the machine, not the code: on a loaded shared machine a test's
# first draws (Hypothesis builds its table of Unicode characters for `st.characters` on them) took
# 14 s, and test_formats' round trip failed its too_slow health check (load 18). What the property
# tests assert does not depend on time.
try:
    from hypothesis import HealthCheck, settings
except ImportError:  # the verifiers suite's venv (make test-verifiers) has no property tests
    pass
else:
    settings.register_profile("rollout-tests", deadline=None, suppress_health_check=[HealthCheck.too_slow])
    settings.load_profile("rollout-tests")


def _run_in_thread(function: Callable[[], T]) -> T:
    """Run blocking or asyncio.run-based setup on a fresh thread, clear of any test event loop."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as executor:
        return executor.submit(function).result()


def _postgres(statement_fn: Callable[[asyncpg.Connection], Awaitable[object]]) -> None:
    async def run() -> None:
        admin_url = make_url(POSTGRES_ADMIN_URL).set(drivername="postgresql")
        connection = await asyncpg.connect(
            admin_url.render_as_string(hide_password=False), timeout=CONNECT_TIMEOUT_SECONDS
        )
        try:
            await statement_fn(connection)
        finally:
            await connection.close()

    _run_in_thread(lambda: asyncio.run(run()))


def _postgres_url(database: str) -> str:
    url = make_url(POSTGRES_ADMIN_URL).set(drivername="postgresql+asyncpg", database=database)
    return url.render_as_string(hide_password=False)


def _create_database(name: str, template: str | None = None) -> None:
    suffix = f" TEMPLATE {template}" if template else ""

    async def create(connection: asyncpg.Connection) -> None:
        await connection.execute(f"CREATE DATABASE {name}{suffix}")

    _postgres(create)


def _drop_database(name: str) -> None:
    async def drop(connection: asyncpg.Connection) -> None:
        await connection.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")

    _postgres(drop)


@pytest.fixture(scope="session")
def postgres_template() -> Iterator[str]:
    """Name of a PostgreSQL database migrated to head, to clone per test."""
    name = f"rollout_tpl_{uuid.uuid4().hex[:12]}"
    try:
        _create_database(name)
    except (TimeoutError, OSError, asyncpg.PostgresError) as error:
        reason = f"PostgreSQL unreachable at {POSTGRES_ADMIN_URL}: {error!r}"
        if SKIP_POSTGRES:
            pytest.skip(f"{reason} (ROLLOUT_SKIP_POSTGRES=1)")
        pytest.fail(f"{reason}. Start it, or set ROLLOUT_SKIP_POSTGRES=1 to skip these tests.", pytrace=False)
    try:
        _run_in_thread(lambda: run_migrations(_postgres_url(name)))
        yield name
    finally:
        _drop_database(name)


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite file migrated to head, to copy per test."""
    path = tmp_path_factory.mktemp("sqlite_template") / "template.db"
    _run_in_thread(lambda: run_migrations(f"sqlite+aiosqlite:///{path}"))
    return path


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def database_url(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if backend == "sqlite":
        template: Path = request.getfixturevalue("sqlite_template")
        path = tmp_path / "rollouts.db"
        shutil.copyfile(template, path)
        yield f"sqlite+aiosqlite:///{path}"
        return
    name = f"rollout_test_{uuid.uuid4().hex[:12]}"
    _create_database(name, template=request.getfixturevalue("postgres_template"))
    try:
        yield _postgres_url(name)
    finally:
        _drop_database(name)


@pytest.fixture
def empty_database_url(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if backend == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path / 'empty.db'}"
        return
    request.getfixturevalue("postgres_template")  # fails or skips when the server is unreachable
    name = f"rollout_test_{uuid.uuid4().hex[:12]}"
    _create_database(name)
    try:
        yield _postgres_url(name)
    finally:
        _drop_database(name)


@pytest.fixture
async def db(database_url: str) -> AsyncIterator[Database]:
    database = Database.open(database_url, connect_timeout=CONNECT_TIMEOUT_SECONDS)
    try:
        yield database
    finally:
        await database.dispose()


# ---- the service over HTTP, against a simulated SGLang worker ----


@pytest.fixture
def sim() -> Iterator[tuple[SimWorker, str]]:
    """A simulated SGLang worker on a free port: (its state and request log, its URL)."""
    worker = SimWorker(SimConfig(latency_seconds=0.01))
    with serve_in_thread(create_sim_app(worker.config, worker=worker)) as url:
        yield worker, url


@pytest.fixture
def agent_sim() -> Iterator[tuple[SimWorker, str]]:
    """A simulated SGLang worker whose policy plays the weather agent (tests/support/agents.py)."""
    worker = SimWorker(SimConfig(latency_seconds=0.01, policy=weather_policy))
    with serve_in_thread(create_sim_app(worker.config, worker=worker)) as url:
        yield worker, url


@pytest.fixture
async def agent_service(
    database_url: str, agent_sim: tuple[SimWorker, str]
) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client of the service, whose external agents the weather policy answers."""
    app = create_app(service_settings(database_url, agent_sim[1], external_idle_seconds=600))
    async with serve_app(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        yield http


def service_settings(database_url: str, sglang_url: str, **overrides: object) -> Settings:
    values: dict[str, object] = {
        **TEST_SETTINGS,
        "database_url": database_url,
        "sglang_url": sglang_url,
        "env_executor": "thread",
        "engine_backoff_seconds": 0.05,
        "tune_gc": False,  # process-wide: the suite runs many apps in one process
    }
    values.update(overrides)
    return Settings(**values)  # type: ignore[arg-type]


def one_shop_episode(sampling_params: dict[str, Any], **more: object) -> dict[str, Any]:
    """A submit's body for one episode of builtin/shop's test task 0 (`more`: max_turns, ...)."""
    return {
        "env": "builtin/shop",
        "task_split": "test",
        "task_indices": [0],
        "sampling_params": sampling_params,
        **more,
    }


@pytest.fixture
async def client(database_url: str, sim: tuple[SimWorker, str]) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client of the whole service (worker included) served on a free port."""
    app = create_app(service_settings(database_url, sim[1]))
    async with serve_app(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        yield http


@pytest.fixture(scope="session")
def openenv_client() -> None:
    """openenv-core's client imported before a test starts a service with an OpenEnv env: the
    service imports it then, and that import (5 s of CPU with gradio, 2 s since without) outlasted the
    start-up timeout on a loaded machine. A fixture, not an import at the top of the test modules,
    so that only the workers running these tests pay it, not every worker's collection."""
    importlib.import_module("service.envs.remote.openenv")


WIDER_SCOPES = {"package", "module", "class"}
# Session-scoped fixtures that several modules share, each costly to build once per worker (`shared_group`).
SHARED_GROUPS: set[str] = set()

F = TypeVar("F", bound=Callable[..., Any])


def shared_group(fixture: F) -> F:
    """Marks a session-scoped fixture as one that several modules share, costly to build once per
    worker: the tests using it, whatever their module, are an xdist group of its name, so one worker
    builds it. Under `@pytest.fixture(scope="session")`."""
    SHARED_GROUPS.add(fixture.__name__)
    return fixture


@pytest.fixture(scope="session")
@shared_group
def openenv_servers(openenv_client: None) -> Iterator[OpenEnvServers]:
    """The example's OpenEnv servers (examples/openenv_counter/server.py: two counter envs and a
    guess env), started side by side once for the remote-env modules that share them
    (tests/test_remote_envs.py, tests/test_remote_openenv.py): each start imports openenv-core, the
    slowest part of these modules. Their tests are one xdist group (`shared_group`), so one
    worker starts them. Each test leaves no session open on them (it waits until the servers report 0)."""
    launched = [launch_server(), launch_server(), launch_server(command=GUESS_SERVER)]
    with listening(launched) as (first, second, guess):
        yield OpenEnvServers(counters=[first, second], guess=guess)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (`-n`, with `--dist=loadgroup`), the tests of a module that share a
    module- or class-scoped fixture (a vLLM server, a trainer's stand-in) run on one worker, which
    builds it once, and so do the tests of any module using a `shared_group` session-scoped
    fixture; every other test goes wherever a worker is free (tests/test_xdist_groups.py).
    First of the hook's implementations: xdist's worker reads the marks in its own, which pluggy
    calls before this conftest's otherwise (the last registered first): it saw no mark."""
    for item in items:
        if not isinstance(item, pytest.Function):
            continue
        definitions = item._fixtureinfo.name2fixturedefs
        shared = sorted(SHARED_GROUPS.intersection(item.fixturenames))
        if shared:
            item.add_marker(pytest.mark.xdist_group(shared[0]))
        elif any(defs[-1].scope in WIDER_SCOPES for defs in definitions.values() if defs):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__ if item.module else item.nodeid))


class _LongTestsFirst:
    """xdist's loadgroup hands out the groups of several tests first, the largest first, then the other
    tests and groups in the collection's order: those with a long test (marked slow) lead it, so that
    none starts last and alone. Last of the hook's implementations, after pytest-random-order's
    shuffle (`--random-order`), whose order it keeps within the long ones and within the others
    (sorted first, the shuffle undid it: test_xdist_groups failed in a random-order run)."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        slow = {_scope(item) for item in items if item.get_closest_marker("slow")}
        items.sort(key=lambda item: _scope(item) not in slow)


def _scope(item: pytest.Item) -> str:
    """What xdist's loadgroup sends to one worker: the test's group, else the test alone."""
    return _xdist_group(item) or item.nodeid


def _xdist_group(item: pytest.Item) -> str | None:
    """The test's group as xdist's worker names it (xdist/remote.py, 3.8): every `xdist_group`
    mark's name, sorted and joined."""
    names = {
        str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
        for mark in item.iter_markers("xdist_group")
    }
    return "_".join(sorted(names)) or None


class _GroupInNodeId:
    """xdist sends a group's tests to one worker by the `@<group>` its worker appends to their node
    ids, by setting `item._nodeid`, which pytest 9.2 no longer reads (its node ids are structured:
    `item._id`), so no test was grouped and each worker given a vLLM test started a vLLM server
    (pytest-dev/pytest-xdist#1386, fix not released in 3.8.0). Appends it where xdist could not,
    after xdist's hook; a no-op once xdist's own took effect. Workers of `--dist=loadgroup` only."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:
            group = _xdist_group(item)
            if group and not item.nodeid.endswith(f"@{group}") and hasattr(item, "_id"):
                item._id = NodeId.parse(f"{item.nodeid}@{group}")


class _RerunTracebacks:
    """What each rerun test failed with, at the end of the run's summary: pytest-rerunfailures
    names a rerun test (`-rR`) but prints nothing of its failure, and a test that passed on its
    rerun in CI could not be told from noise. In the process that reports (xdist's controller)."""

    def __init__(self) -> None:
        self.reruns: list[pytest.TestReport] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.outcome == "rerun":  # type: ignore[comparison-overlap]  # the plugin's own outcome
            self.reruns.append(report)

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not self.reruns:
            return
        terminalreporter.section("what the rerun tests failed with", sep="=")
        for report in self.reruns:
            terminalreporter.section(f"{report.nodeid} ({report.when})", sep="-")
            terminalreporter.line(report.longreprtext)


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(_LongTestsFirst(), "rollout-long-tests-first")
    config.pluginmanager.import_plugin("tests.support.open_connections")
    if hasattr(config, "workerinput"):
        if config.getvalue("loadgroup"):
            config.pluginmanager.register(_GroupInNodeId(), "rollout-xdist-group-in-node-id")
    elif config.pluginmanager.hasplugin("rerunfailures"):
        config.pluginmanager.register(_RerunTracebacks(), "rollout-rerun-tracebacks")
