"""`serve --workers N`: N service processes on one listening socket and one database, so that a
machine's cores all work. The parent binds the socket, starts the processes, replaces one that dies,
and on SIGTERM or SIGINT has each drain as a single `serve` does. It serves nothing itself."""

from __future__ import annotations

import logging
import math
import multiprocessing
import os
import signal
import socket
import threading
import time
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from types import FrameType

from uvicorn.config import STARTUP_FAILURE

from service.config import Settings
from service.logs import configure_logging

logger = logging.getLogger(__name__)

LISTEN_BACKLOG = 2048  # uvicorn's default
RESTART_DELAY_SECONDS = 1.0  # before a process that died is replaced: a crash loop does not spin
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


def listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=LISTEN_BACKLOG)


def serve_process(settings: Settings, sock: socket.socket) -> None:
    """A service process (spawned): the whole service, accepting on the shared socket."""
    from service.serving import run_service  # imported here: the parent serves nothing

    configure_logging(settings.log_level)
    threading.Thread(target=_drain_when_orphaned, name="orphan watch", daemon=True).start()
    run_service(settings, sockets=[sock])


def _drain_when_orphaned() -> None:
    """A supervisor that died (SIGKILL, OOM) cannot stop or replace its processes: each then drains
    and exits rather than go on serving unsupervised."""
    parent = multiprocessing.parent_process()
    if parent is not None:
        parent.join()  # its sentinel closes when the parent dies, however it dies
        logger.error("the supervisor %d died: draining", parent.pid)
        os.kill(os.getpid(), signal.SIGTERM)


class Supervisor:
    """Runs `processes` service processes on `sock` until SIGTERM or SIGINT, which each of them is
    sent; returns once all have exited. One that dies meanwhile is reported and replaced, unless it
    failed to start (uvicorn's exit code 3: the configuration, not bad luck), which stops them all."""

    def __init__(self, settings: Settings, processes: int, sock: socket.socket) -> None:
        self.settings = process_settings(settings, processes)
        self.count = processes
        self.sock = sock
        self.context = multiprocessing.get_context("spawn")
        self.processes: dict[int, BaseProcess] = {}  # by sentinel
        self.stopping = False
        self.exit_code = 0

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        host, port = self.sock.getsockname()[:2]
        logger.info("serving on %s:%d with %d service processes", host, port, self.count)
        for _ in range(self.count):
            self._start()
        while self.processes:
            wait(list(self.processes))
            for sentinel, process in list(self.processes.items()):
                if process.exitcode is not None:
                    del self.processes[sentinel]
                    process.join()
                    self._exited(process)
        return self.exit_code

    def _start(self) -> None:
        if self.stopping:
            return
        process = self.context.Process(target=serve_process, args=(self.settings, self.sock))
        process.start()
        self.processes[process.sentinel] = process
        logger.info("service process %d started", process.pid)
        if self.stopping:  # the signal came while it was starting, before it could be sent on
            process.terminate()

    def _exited(self, process: BaseProcess) -> None:
        code = process.exitcode
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
            self._start()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        logger.info("%s: stopping the service processes", signal.Signals(signum).name)
        self._stop()

    def _stop(self) -> None:
        self.stopping = True
        for process in list(self.processes.values()):
            process.terminate()  # SIGTERM: it drains as a single process does
