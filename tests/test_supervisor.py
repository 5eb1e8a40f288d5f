"""`serve --workers 2`: two service processes behind one port over one database. A batch submitted to
that port runs on both, each episode once; SIGTERM to the parent drains both and exits 0; a process
that dies is replaced; one that cannot start stops the service; if the parent dies, they drain."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.mmap_dict import MmapedDict, mmap_key
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from service.__main__ import main
from service.config import Settings
from service.metrics import MULTIPROCESS_DIR_VARIABLE
from service.records import FINISHED_STATUSES
from service.sim.worker import SimWorker
from service.sockets import listen
from service.storage.db import Database
from service.storage.models import Episode
from service.supervisor import host_metrics, process_settings
from tests.support.contract import assert_trainer_contract, sim_calls
from tests.support.ports import free_port
from tests.support.service_process import (
    PLAN_TO_THE_END,
    REPO_DIR,
    SERVICE_ENV,
    ServiceProcess,
    attempts_seen,
    episodes_of,
    in_second_call,
    service_process,
    simulated_sglang,
    submission,
    submit,
    wait_batch_finished,
    wait_for,
)

WORKERS = 2
SETTINGS: dict[str, object] = {
    "serve_workers": WORKERS,
    "env_executor": "thread",
    # The command's total, 4 per process: neither can claim a whole batch the moment it arrives.
    "max_running_episodes": 8,
}
TASKS, SAMPLES = 12, 2
START_TIMEOUT_SECONDS = 60.0
MID_BATCH_TIMEOUT_SECONDS = 30.0
FINISH_TIMEOUT_SECONDS = 60.0
EXIT_MARGIN_SECONDS = 10.0  # uvicorn's shutdown in each process, interpreter exits, on a busy machine
LEASE_SECONDS = 3  # a killed process's episodes are re-queued within about this long


async def start_processes(service: ServiceProcess, count: int = WORKERS) -> list[int]:
    """Waits until `count` service processes have started (their lifespans complete); their pids."""

    async def started() -> bool:
        return len(startup_pids(service)) >= count

    await wait_for(started, START_TIMEOUT_SECONDS, f"{count} service processes to start")
    return startup_pids(service)


def startup_pids(service: ServiceProcess) -> list[int]:
    return [
        int(line["pid"]) for line in service.log_lines() if line["message"] == "Application startup complete."
    ]


def pid_of(worker_id: str) -> int:
    return int(worker_id.rsplit(":", 2)[1])  # host:pid:uuid


async def run_watching_owners(db: Database, batch_id: str) -> tuple[list[Episode], dict[str, set[str]]]:
    """Waits for the batch to finish, noting the lease owner (worker id) of each episode seen running:
    a finished episode's row no longer names it."""
    owners: dict[str, set[str]] = defaultdict(set)

    async def finished() -> bool:
        episodes = await episodes_of(db, batch_id)
        for episode in episodes:
            if episode.status == "running" and episode.lease_owner is not None:
                owners[episode.id].add(episode.lease_owner)
        return all(episode.status in FINISHED_STATUSES for episode in episodes)

    await wait_for(finished, FINISH_TIMEOUT_SECONDS, f"batch {batch_id} to finish")
    return await episodes_of(db, batch_id), owners


def assert_ran_once(
    sim: SimWorker, episode: Episode, attempt: int = 0, service: ServiceProcess | None = None
) -> None:
    """A failure shows what `service`'s log says of the episode and of leases (a lease lost shows there)."""
    assert episode.status in {"completed", "truncated", "aborted"}, (
        episode.id, episode.error, episode_log(service, episode.id)
    )  # fmt: skip
    assert episode.attempt == attempt and max(attempts_seen(sim, episode.id)) == attempt, (
        episode.id, episode.attempt, attempt, attempts_seen(sim, episode.id), episode_log(service, episode.id)
    )  # fmt: skip
    tokens = episode.tokens()
    assert tokens is not None
    calls = sim_calls(sim, episode.id, attempt)
    assert len(calls) == episode.num_turns > 0
    # A turn sent twice (two processes running one attempt) would show as a duplicate rid.
    rids = [r.rid for r in sim.requests if r.rid.startswith(f"{episode.id}:{attempt}:")]
    assert len(rids) == len(set(rids)) == episode.num_turns
    assert_trainer_contract(
        tokens.prompt_ids, tokens.response_ids, tokens.loss_mask, tokens.rollout_logprobs, calls
    )


def episode_log(service: ServiceProcess | None, episode_id: str) -> str:
    if service is None:
        return ""
    lines = service.log_path.read_text(errors="replace").splitlines()
    return "\n".join(line for line in lines if episode_id in line or "re-queued" in line or "lease" in line)


def messages_of(service: ServiceProcess, pid: int) -> list[str]:
    return [line["message"] for line in service.log_lines() if line.get("pid") == pid]


def command_line(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().replace("\0", " ")


async def test_two_processes_share_one_port_and_run_each_episode_once(
    database_url: str, db: Database, tmp_path: Path
) -> None:
    async with simulated_sglang(latency_seconds=0.1) as (sim, sglang_url):
        async with service_process(tmp_path, database_url, sglang_url, "workers", **SETTINGS) as service:
            children = await start_processes(service)
            command_lines = {pid: command_line(pid) for pid in children}
            episode_ids = await submit(service.url, "shared", TASKS, SAMPLES)
            episodes, owners = await run_watching_owners(db, "shared")
            service.terminate()
            assert await service.wait_exit(EXIT_MARGIN_SECONDS) == 0, service.log_tail()

    assert len(set(children)) == WORKERS and service.pid not in children
    # Forked by the supervisor's forkserver, which imported the service once: each kept its command
    # line (a spawned process's runs multiprocessing.spawn, and imports everything again).
    assert all("multiprocessing.forkserver" in command_lines[pid] for pid in children), command_lines
    assert [episode.id for episode in episodes] == episode_ids
    for episode in episodes:
        assert_ran_once(sim, episode)
        assert len(owners[episode.id]) <= 1, owners[episode.id]  # one lease, never handed over
    # Both processes ran episodes of the batch submitted to the one port.
    assert {pid_of(owner) for seen in owners.values() for owner in seen} == set(children), owners
    parent = messages_of(service, service.pid)
    assert not any("unexpectedly" in message for message in parent), service.log_tail(80)
    for pid in children:
        assert "Application shutdown complete." in messages_of(service, pid), service.log_tail(80)
        assert f"service process {pid} stopped" in parent


@pytest.mark.slow
async def test_sigterm_to_the_parent_drains_every_process(
    database_url: str, db: Database, tmp_path: Path
) -> None:
    shutdown_timeout = 1.0
    async with simulated_sglang(latency_seconds=0.6, **PLAN_TO_THE_END) as (sim, sglang_url):
        async with service_process(
            tmp_path, database_url, sglang_url, "first", shutdown_timeout_seconds=shutdown_timeout, **SETTINGS
        ) as first:  # fmt: skip
            children = await start_processes(first)
            episode_ids = await submit(first.url, "drain", 8, SAMPLES)

            async def mid_batch() -> bool:
                # Both processes run episodes, one in its second call: its plan's 3 more (> the timeout) left.
                running = [e for e in await episodes_of(db, "drain") if e.status == "running"]
                early = in_second_call(sim)
                owners = {pid_of(e.lease_owner) for e in running if e.lease_owner is not None}
                return owners == set(children) and any(e.id in early for e in running)

            await wait_for(mid_batch, MID_BATCH_TIMEOUT_SECONDS, "both processes to be mid-batch")
            first.terminate()
            started = time.monotonic()
            assert await first.wait_exit(shutdown_timeout + EXIT_MARGIN_SECONDS) == 0, first.log_tail()
            assert time.monotonic() - started >= shutdown_timeout  # it drained

        after = await episodes_of(db, "drain")
        assert not any(episode.status == "running" for episode in after)
        released = {e.id for e in after if e.status == "queued" and e.attempt == 1}
        assert released, "every episode finished within the shutdown timeout: make them longer"
        for episode in after:
            if episode.status == "queued":
                assert episode.lease_owner is None and episode.lease_expires_at is None
        for pid in children:
            messages = messages_of(first, pid)
            assert "Application shutdown complete." in messages and "draining " in "".join(messages)

        # Nothing was lost: another `serve --workers 2` finishes the batch, each episode once.
        async with service_process(tmp_path, database_url, sglang_url, "second", **SETTINGS):
            episodes = await wait_batch_finished(db, "drain", FINISH_TIMEOUT_SECONDS)

    assert [episode.id for episode in episodes] == episode_ids
    for episode in episodes:
        assert_ran_once(sim, episode, attempt=1 if episode.id in released else 0, service=first)


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
async def test_a_process_that_dies_is_replaced_and_its_episodes_rerun(
    database_url: str, db: Database, tmp_path: Path
) -> None:
    async with simulated_sglang(latency_seconds=0.3) as (sim, sglang_url):
        async with service_process(
            tmp_path, database_url, sglang_url, "workers", lease_seconds=LEASE_SECONDS, **SETTINGS
        ) as service:
            children = await start_processes(service)
            episode_ids = await submit(service.url, "crash", 8, SAMPLES)
            victim = children[0]

            async def victim_running() -> bool:
                episodes = await episodes_of(db, "crash")
                return any(e.lease_owner and pid_of(e.lease_owner) == victim for e in episodes)

            await wait_for(victim_running, MID_BATCH_TIMEOUT_SECONDS, "the victim to run episodes")
            os.kill(victim, signal.SIGKILL)
            reported = f"service process {victim} exited unexpectedly (exit code -9); starting another"

            async def reaped() -> bool:
                return reported in messages_of(service, service.pid)

            await wait_for(reaped, MID_BATCH_TIMEOUT_SECONDS, "the parent to report the death")
            # What the victim left running, before its leases expire and another process re-queues it.
            interrupted = {
                e.id
                for e in await episodes_of(db, "crash")
                if e.status == "running" and e.lease_owner and pid_of(e.lease_owner) == victim
            }
            replacement = (await start_processes(service, WORKERS + 1))[-1]
            episodes = await wait_batch_finished(db, "crash", FINISH_TIMEOUT_SECONDS)
            service.terminate()
            assert await service.wait_exit(EXIT_MARGIN_SECONDS) == 0, service.log_tail()

    assert interrupted and replacement not in children
    assert f"service process {replacement} started" in messages_of(service, service.pid)
    assert [episode.id for episode in episodes] == episode_ids
    for episode in episodes:
        # The victim's episodes were re-queued when their lease expired and ran again, once.
        assert_ran_once(sim, episode, attempt=1 if episode.id in interrupted else 0, service=service)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
async def test_processes_drain_and_exit_when_the_parent_dies(database_url: str, tmp_path: Path) -> None:
    async with simulated_sglang(latency_seconds=0.05) as (_, sglang_url):
        async with service_process(tmp_path, database_url, sglang_url, "workers", **SETTINGS) as service:
            children = await start_processes(service)
            os.kill(service.pid, signal.SIGKILL)  # the parent only: nobody is left to stop them

            async def orphans_gone() -> bool:
                return not any(alive(pid) for pid in children)

            await wait_for(orphans_gone, EXIT_MARGIN_SECONDS, "the orphaned processes to exit")
    for pid in children:
        messages = messages_of(service, pid)
        assert f"the supervisor {service.pid} died: draining" in messages
        assert "Application shutdown complete." in messages


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
async def test_a_process_that_cannot_start_stops_the_service(database_url: str, tmp_path: Path) -> None:
    # A tokenizer directory the command line's check passes (it holds a tokenizer.json) and that
    # the service processes fail to load (it is not one).
    broken = tmp_path / "broken-tokenizer"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("not a tokenizer")
    environment = {
        **os.environ,
        **{key.upper(): str(value) for key, value in (SERVICE_ENV | SETTINGS).items()},
        "DATABASE_URL": database_url,
        "TOKENIZER_PATH": str(broken),
    }
    log_path = tmp_path / "service.log"
    with log_path.open("wb") as log:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "service", "serve", "--port", str(free_port()),
            cwd=REPO_DIR, env=environment, stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log,
            start_new_session=True,
        )  # fmt: skip
    try:
        exit_code = await asyncio.wait_for(process.wait(), START_TIMEOUT_SECONDS)
    finally:
        if process.returncode is None:
            os.killpg(process.pid, signal.SIGKILL)
            await process.wait()
    assert exit_code == 3, log_path.read_text()  # uvicorn's STARTUP_FAILURE, as a single process exits
    assert "failed to start; stopping the others" in log_path.read_text()


def test_the_concurrency_bounds_are_the_commands_shared_among_its_processes() -> None:
    settings = Settings(max_running_episodes=2048, max_inflight_generates=511, env_workers=1, serve_workers=3)
    each = process_settings(settings, 3)
    assert (each.max_running_episodes, each.max_inflight_generates, each.env_workers) == (683, 171, 1)
    assert each.serve_workers == 1 and each.database_url == settings.database_url
    assert process_settings(settings, 1).max_running_episodes == 2048


def test_workers_must_be_positive(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--workers", "0"])
    assert exit_.value.code == 2 and "--workers must be at least 1" in capsys.readouterr().err


async def test_api_processes_take_every_request_and_the_workers_every_episode(
    database_url: str, db: Database, tmp_path: Path
) -> None:
    settings = SETTINGS | {"serve_workers": 1, "serve_api_processes": 1}
    async with simulated_sglang(latency_seconds=0.05) as (sim, sglang_url):
        async with service_process(tmp_path, database_url, sglang_url, "api", **settings) as service:
            children = await start_processes(service, 2)
            episode_ids = await submit(service.url, "split", TASKS, SAMPLES)
            episodes, owners = await run_watching_owners(db, "split")
            service.terminate()
            assert await service.wait_exit(EXIT_MARGIN_SECONDS) == 0, service.log_tail()

    assert [episode.id for episode in episodes] == episode_ids
    for episode in episodes:
        assert_ran_once(sim, episode)
    (worker,) = {pid_of(owner) for seen in owners.values() for owner in seen}
    (api,) = set(children) - {worker}
    assert any(message.startswith("worker ") for message in messages_of(service, worker))
    assert not any(message.startswith("worker ") for message in messages_of(service, api))
    requests = [line for line in service.log_lines() if "POST /episodes" in line["message"]]
    assert requests and {line["pid"] for line in requests} == {api}, requests


def test_connections_to_the_listening_socket_send_at_once() -> None:
    """No Nagle: a response's body must not wait behind its headers for the client's delayed ACK."""
    with listen("127.0.0.1", 0) as server, socket.create_connection(server.getsockname()[:2]):
        accepted, _ = server.accept()
        with accepted:
            assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0


async def test_metrics_count_for_the_whole_host_and_answer_probes_without_a_key(
    database_url: str, db: Database, tmp_path: Path
) -> None:
    """Two workers and an API process: whichever takes a scrape, /metrics shows every process's
    counts (the API process submitted the batch, the workers ran it), without an API key."""
    settings = SETTINGS | {"serve_workers": 2, "serve_api_processes": 1, "api_keys": "k1"}
    async with simulated_sglang(latency_seconds=0.05) as (_, sglang_url):
        async with service_process(tmp_path, database_url, sglang_url, "host", **settings) as service:
            await start_processes(service, 3)
            async with httpx.AsyncClient(base_url=service.url, timeout=10) as http:
                body = submission("host", TASKS, SAMPLES)
                response = await http.post("/episodes", json=body, headers={"Authorization": "Bearer k1"})
                assert response.status_code == 202, response.text
                episodes = await wait_batch_finished(db, "host", FINISH_TIMEOUT_SECONDS)
                assert (await http.get("/ready")).status_code == 200
                assert (await http.get("/batches")).status_code == 401
                scrapes = []
                for _ in range(SCRAPES):  # a new connection each: any process may take it
                    async with httpx.AsyncClient(base_url=service.url, timeout=10) as scraper:
                        scrape = await scraper.get("/metrics")
                    assert scrape.status_code == 200, scrape.text
                    scrapes.append(metric_samples(scrape.text))
            (metrics_dir,) = [
                Path(line["message"].rsplit(" ", 1)[1])
                for line in service.log_lines()
                if line["message"].startswith("metrics of the service processes in ")
            ]
            assert list(metrics_dir.glob("counter_*.db"))
            service.terminate()
            assert await service.wait_exit(EXIT_MARGIN_SECONDS) == 0, service.log_tail()

    finished = Counter(episode.status for episode in episodes)
    turns = sum(episode.num_turns for episode in episodes)
    for values in scrapes:
        assert values[("rollout_episodes_submitted_total", ())] == TASKS * SAMPLES
        by_status = {
            dict(labels)["status"]: value
            for (name, labels), value in values.items()
            if name == "rollout_episodes_finished_total" and value
        }
        assert by_status == finished, by_status
        assert values[("rollout_turns_total", ())] == turns
        assert values[("rollout_episodes_outstanding", ())] == 0
        assert values[("rollout_inflight_episodes", ())] == 0
    assert not metrics_dir.exists()  # the run's directory goes with it


SCRAPES = 6


def metric_samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_a_given_metrics_directory_is_emptied_and_a_temporary_one_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a run's processes count starts from zero: values an earlier run left in the directory
    (a pod's emptyDir survives a container restart) would be added to the host's sums."""
    given = tmp_path / "metrics"
    given.mkdir()
    stale = MmapedDict(str(given / "counter_4242.db"))
    stale.write_value(mmap_key("rollout_turns", "rollout_turns_total", [], [], "old"), 1000.0, 0.0)
    stale.close()
    assert metric_samples(render_directory(given))[("rollout_turns_total", ())] == 1000
    monkeypatch.setenv(MULTIPROCESS_DIR_VARIABLE, str(given))
    with host_metrics() as directory:
        assert directory == given and not list(given.iterdir())
        assert os.environ[MULTIPROCESS_DIR_VARIABLE] == str(given)
    assert given.is_dir()  # the operator's directory stays

    monkeypatch.delenv(MULTIPROCESS_DIR_VARIABLE)
    with host_metrics() as directory:
        assert directory.is_dir() and os.environ[MULTIPROCESS_DIR_VARIABLE] == str(directory)
    assert not directory.exists() and MULTIPROCESS_DIR_VARIABLE not in os.environ


def render_directory(directory: Path) -> str:
    registry = CollectorRegistry()
    MultiProcessCollector(registry, str(directory))
    return generate_latest(registry).decode()
