"""The errors of env work (EnvHost and its worker processes); `service.envs.host` re-exports them."""

from __future__ import annotations

import signal
import traceback


class EnvHostError(Exception):
    """Base of the errors EnvHost raises."""


class EnvNotFound(EnvHostError, LookupError):
    """An unknown environment name or split."""


class EnvError(EnvHostError):
    """Environment code raised: the original exception's type, message and traceback, as text
    (it crossed a process boundary, and its class may not be importable on this side)."""

    def __init__(self, exc_type: str, message: str, traceback: str = "") -> None:
        super().__init__(exc_type, message, traceback)
        self.exc_type = exc_type
        self.message = message
        self.traceback = traceback

    def __str__(self) -> str:
        return f"{self.exc_type}: {self.message}"

    @classmethod
    def from_exception(cls, exc: BaseException) -> EnvError:
        if isinstance(exc, EnvError):
            return exc
        exc_type = type(exc)
        name = exc_type.__qualname__
        if exc_type.__module__ not in ("builtins", "__main__"):
            name = f"{exc_type.__module__}.{name}"
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        return cls(name, str(exc), text)


class EnvWorkerCrashed(EnvHostError):
    """The worker process an episode was pinned to died; the episode's environment is gone."""


class EnvHostClosed(EnvHostError):
    """The host was shut down."""


def describe_exit(pid: int | None, exitcode: int | None) -> str:
    """'pid 12 exited with code 7' or 'pid 12 killed by SIGKILL', from a process's exit code."""
    if exitcode is None:
        return f"pid {pid} exited abruptly"
    if exitcode < 0:
        try:
            return f"pid {pid} killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"pid {pid} killed by signal {-exitcode}"
    return f"pid {pid} exited with code {exitcode}"
