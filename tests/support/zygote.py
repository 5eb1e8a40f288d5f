"""A preloaded parent for the tests' `python -m service ...` processes: one per test process, it
imports the service and transformers' tokenizer classes once, then forks each service process the
tests ask for, which runs `python -m service <argv>` as a fresh interpreter would (its own session,
environment, working directory and log file). Exec'd afresh, a `serve` from start to stop cost 3 s
of CPU (its imports 2.6 s), forked 0.4 s; the suite starts about a hundred, and forking them took
its CPU from 851 to 679 s and its wall from 9:15 to 7:25 (the whole suite, this machine, quiet).

Only what a fork cannot reproduce goes the exec way: an environment whose variables read at import
time (IMPORT_TIME_VARIABLES) differ from the zygote's. Run as `python -m tests.support.zygote`: it
reads one JSON request a line on stdin and writes one JSON line on stdout per forked process
({"pid"}) and per exit ({"exited", "returncode"} as subprocess reports it), and exits at stdin's
end."""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from service import supervisor

# What the zygote imports before it forks: the command line, and what every service process imports
# before it serves (as `serve --workers`' forkserver preloads it).
PRELOADED_MODULES = ("service.__main__", *supervisor.PRELOADED_MODULES)
# Environment variables read while those modules import (the interpreter's own, Hugging Face's and
# prometheus_client's multiprocess mode): a process whose environment differs in any of them is
# exec'd, not forked.
IMPORT_TIME_VARIABLES = ("PYTHON", "HF_", "HUGGINGFACE", "TRANSFORMERS", "TOKENIZERS", "PROMETHEUS")
# Except this one, which the service sets itself before it imports transformers (and the zygote
# likewise), and which the tests' processes come to have once they tokenize in-process.
QUIET_TRANSFORMERS = "TRANSFORMERS_NO_ADVISORY_WARNINGS"


def import_time_environment(environment: Mapping[str, str]) -> dict[str, str]:
    return {
        key: value
        for key, value in environment.items()
        if key.startswith(IMPORT_TIME_VARIABLES) and key != QUIET_TRANSFORMERS
    }


# The zygote's side.


def _write(message: dict[str, Any]) -> None:
    os.write(sys.stdout.fileno(), (json.dumps(message) + "\n").encode())


def _exit_code(status: int) -> int:
    """A wait status as subprocess's returncode: the exit code, or minus the signal that ended it."""
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _run_child(request: dict[str, Any]) -> None:
    """In the forked child: becomes `python -m service <argv>` and never returns (its SystemExit
    ends the interpreter as the real command's would, running its atexit handlers)."""
    import random
    import runpy

    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.setsid()
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    random.seed()
    sys.argv = ["service", *request["argv"]]
    runpy.run_module("service", run_name="__main__", alter_sys=True)
    sys.exit(0)


def serve_forks() -> None:
    import importlib
    import warnings

    # Python warns at each fork that pyarrow's threads (jemalloc's background thread, Arrow's pool)
    # run in this process: both handle a fork (at-fork handlers), as in the forkserver that
    # `serve --workers` forks its processes from.
    warnings.filterwarnings("ignore", r"This process \(pid=\d+\) is multi-threaded", DeprecationWarning)
    os.environ.setdefault(QUIET_TRANSFORMERS, "1")
    for module in PRELOADED_MODULES:
        importlib.import_module(module)
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)
    os.set_blocking(write_end, False)
    signal.set_wakeup_fd(write_end)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    selector = selectors.DefaultSelector()
    selector.register(sys.stdin.fileno(), selectors.EVENT_READ)
    selector.register(read_end, selectors.EVENT_READ)
    pending = b""
    while True:
        for key, _ in selector.select():
            if key.fd == read_end:
                os.read(read_end, 4096)
                _reap()
                continue
            chunk = os.read(key.fd, 65536)
            if not chunk:
                return
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    _run_child(request)
                _write({"pid": pid})


def _reap() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _write({"exited": pid, "returncode": _exit_code(status)})


# The tests' side.


class ForkedProcess:
    """A process the zygote forked, with subprocess.Popen's methods that the tests and benches use."""

    def __init__(self, pid: int, args: list[str]) -> None:
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self.exited = threading.Event()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self.exited.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:  # exited; the zygote's word of it is on its way
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The zygote process of this test process, started on first use; a reader thread takes its
    answers."""

    def __init__(self) -> None:
        self.environment = dict(os.environ)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.support.zygote"],
            cwd=Path(__file__).resolve().parents[2], env=self.environment,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )  # fmt: skip
        self.lock = threading.Lock()
        self.forked: dict[int, ForkedProcess] = {}
        self.early_exits: dict[int, int] = {}  # exits read before their fork's answer
        self.answers: list[int] = []
        self.answered = threading.Condition(self.lock)
        threading.Thread(target=self._read, name="zygote reader", daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            message = json.loads(line)
            with self.lock:
                if "pid" in message:
                    self.answers.append(message["pid"])
                    self.answered.notify_all()
                elif (process := self.forked.get(message["exited"])) is not None:
                    process.returncode = message["returncode"]
                    process.exited.set()
                else:
                    self.early_exits[message["exited"]] = message["returncode"]
        with self.lock:  # the zygote died: nothing more will be answered
            self.answered.notify_all()

    def can_fork(self, environment: Mapping[str, str]) -> bool:
        same = import_time_environment(environment) == import_time_environment(self.environment)
        return same and self.process.poll() is None

    def fork(
        self, argv: Sequence[str], environment: Mapping[str, str], cwd: Path, log: Path
    ) -> ForkedProcess:
        request = {"argv": list(argv), "env": dict(environment), "cwd": str(cwd), "log": str(log)}
        assert self.process.stdin is not None
        with self.lock:
            self.process.stdin.write(json.dumps(request).encode() + b"\n")
            self.process.stdin.flush()
            if not self.answered.wait_for(lambda: self.answers or self.process.poll() is not None, 60):
                raise RuntimeError("the zygote did not answer within 60 s")
            if not self.answers:
                raise RuntimeError(f"the zygote exited with {self.process.returncode}")
            process = ForkedProcess(self.answers.pop(0), [sys.executable, "-m", "service", *argv])
            self.forked[process.pid] = process
            if (code := self.early_exits.pop(process.pid, None)) is not None:
                process.returncode = code
                process.exited.set()
        return process


_zygote: Zygote | None = None

ServiceCommand = subprocess.Popen[bytes] | ForkedProcess


def launch(argv: Sequence[str], environment: Mapping[str, str], cwd: Path, log: Path) -> ServiceCommand:
    """`python -m service <argv>` in a session of its own, its output to `log`: forked by this test
    process's zygote (started on first use) where the environment allows, else exec'd."""
    global _zygote
    if _zygote is None or _zygote.process.poll() is not None:
        _zygote = Zygote()
    if _zygote.can_fork(environment):
        return _zygote.fork(argv, environment, cwd, log)
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "service", *argv], cwd=cwd, env=environment,
            stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True,
        )  # fmt: skip


if __name__ == "__main__":
    serve_forks()
