"""`serve --workers N [--api-processes M]`: service processes on one listening socket and one
database, so that a machine's cores all work. The parent binds the socket, starts the processes,
replaces one that dies, and on SIGTERM or SIGINT has each drain as a single `serve` does. It serves
nothing itself.

Without API processes each of the N is the whole service. With M of them, the M serve the API alone
on the socket and the N run episodes, each on a private loopback port that no trainer calls: a poll
or a pull then never waits behind the episodes' CPU, however many run."""

from __future__ import annotations

import logging
import math
import multiprocessing
import os
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import FrameType

from prometheus_client.multiprocess import mark_process_dead
from uvicorn.config import STARTUP_FAILURE

from service.config import Settings
from service.logs import configure_logging
from service.metrics import MULTIPROCESS_DIR_VARIABLE, clear_multiprocess_dir

logger = logging.getLogger(__name__)

RESTART_DELAY_SECONDS = 1.0  # before a process that died is replaced: a crash loop does not spin
# What every service process imports before it serves: the service, and transformers' tokenizer
# classes (imported on first use, at start where episodes run: the dearest import of all).
PRELOADED_MODULES = ("service.serving", "transformers.models.auto.tokenization_auto")
# How a process ends once asked to stop: uvicorn drains, then re-raises the signal it drained on.
STOPPED_EXIT_CODES = {0, -signal.SIGTERM, -signal.SIGINT}


def process_settings(settings: Settings, processes: int) -> Settings:
    """One process's settings: the concurrency bounds are the command's, shared among its processes
    (so `--workers` spreads a batch over them rather than multiplying the load on SGLang)."""

    def share(total: int) -> int:
        return math.ceil(total / processes)

    return settings.model_copy(
        update={
            "serve_workers": 1,
            "max_running_episodes": share(settings.max_running_episodes),
            "max_inflight_generates": share(settings.max_inflight_generates),
            "env_workers": share(settings.env_workers),
        }
    )


def serve_process(settings: Settings, sock: socket.socket | None) -> None:
    """A service process (forked by the supervisor's forkserver): the service `settings` describe,
    accepting on the shared socket, or with none (a worker behind API processes) on a free loopback
    port of its own."""
    from service.serving import run_service  # imported here: the parent serves nothing

    configure_logging(settings.log_level)
    threading.Thread(target=_drain_when_orphaned, name="orphan watch", daemon=True).start()
    if sock is None:
        run_service(settings, "127.0.0.1", 0)
    else:
        run_service(settings, sockets=[sock])


@contextmanager
def host_metrics() -> Iterator[Path]:
    """The directory the processes of this run write their metrics to, empty at start and named in
    the environment they inherit: PROMETHEUS_MULTIPROC_DIR when set (a pod's emptyDir, say), else a
    temporary directory, removed at the end."""
    given = os.environ.get(MULTIPROCESS_DIR_VARIABLE)
    if given:
        clear_multiprocess_dir(Path(given))
        yield Path(given)
        return
    with tempfile.TemporaryDirectory(prefix="rollout-metrics-") as directory:
        os.environ[MULTIPROCESS_DIR_VARIABLE] = directory
        try:
            yield Path(directory)
        finally:
            del os.environ[MULTIPROCESS_DIR_VARIABLE]


def _drain_when_orphaned() -> None:
    """A supervisor that died (SIGKILL, OOM) cannot stop or replace its processes: each then drains
    and exits rather than go on serving unsupervised."""
    parent = multiprocessing.parent_process()
    if parent is not None:
        parent.join()  # its sentinel closes when the parent dies, however it dies
        logger.error("the supervisor %d died: draining", parent.pid)
        os.kill(os.getpid(), signal.SIGTERM)


class Supervisor:
    """Runs `processes` service processes (and `api_processes` API-only ones in front of them) until
    SIGTERM or SIGINT, which each of them is sent; returns once all have exited. One that dies
    meanwhile is reported and replaced, unless it failed to start (uvicorn's exit code 3: the
    configuration, not bad luck), which stops them all."""

    def __init__(
        self, settings: Settings, processes: int, sock: socket.socket, *, api_processes: int = 0
    ) -> None:
        worker_settings = process_settings(settings, processes)
        api_settings = worker_settings.model_copy(update={"run_worker": False})
        # What each process runs and the socket it accepts on (None: a private port).
        self.roles = [(worker_settings, None if api_processes else sock)] * processes
        self.roles += [(api_settings, sock)] * api_processes
        self.sock = sock
        # The processes fork from a server that imported the service once (forkserver, the modules
        # below preloaded), which starts with the first of them, once the metrics directory is in the
        # environment. Spawned, each imported the service and transformers itself: about 5 s of CPU
        # a process, and as long again before a replacement could serve.
        self.context = multiprocessing.get_context("forkserver")
        self.context.set_forkserver_preload(list(PRELOADED_MODULES))
        self.processes: dict[int, tuple[BaseProcess, int]] = {}  # by sentinel: the process, its role
        self.stopping = False
        self.exit_code = 0
        self.metrics_dir: Path | None = None

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        host, port = self.sock.getsockname()[:2]
        api = sum(1 for settings, _ in self.roles if not settings.run_worker)
        count = len(self.roles)
        logger.info("serving on %s:%d with %d service processes (%d API only)", host, port, count, api)
        with host_metrics() as self.metrics_dir:
            logger.info("metrics of the service processes in %s", self.metrics_dir)
            for role in range(len(self.roles)):
                self._start(role)
            while self.processes:
                wait(list(self.processes))
                for sentinel, (process, role) in list(self.processes.items()):
                    if process.exitcode is not None:
                        del self.processes[sentinel]
                        process.join()
                        self._exited(process, role)
        return self.exit_code

    def _start(self, role: int) -> None:
        if self.stopping:
            return
        process = self.context.Process(target=serve_process, args=self.roles[role])
        process.start()
        self.processes[process.sentinel] = (process, role)
        logger.info("service process %d started", process.pid)
        if self.stopping:  # the signal came while it was starting, before it could be sent on
            process.terminate()

    def _exited(self, process: BaseProcess, role: int) -> None:
        code = process.exitcode
        if self.metrics_dir is not None and process.pid is not None:
            # Its gauges leave the live sums.
            mark_process_dead(process.pid, str(self.metrics_dir))  # type: ignore[no-untyped-call]
        if self.stopping:
            if code in STOPPED_EXIT_CODES:
                logger.info("service process %d stopped", process.pid)
            else:
                logger.error("service process %d stopped with exit code %s", process.pid, code)
                self.exit_code = self.exit_code or 1
        elif code == STARTUP_FAILURE:
            logger.error("service process %d failed to start; stopping the others", process.pid)
            self.exit_code = STARTUP_FAILURE
            self._stop()
        else:
            logger.error(
                "service process %d exited unexpectedly (exit code %s); starting another", process.pid, code
            )
            time.sleep(RESTART_DELAY_SECONDS)
            self._start(role)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        logger.info("%s: stopping the service processes", signal.Signals(signum).name)
        self._stop()

    def _stop(self) -> None:
        self.stopping = True
        for process, _ in list(self.processes.values()):
            process.terminate()  # SIGTERM: it drains as a single process does
