"""The errors of env work (EnvHost, its sessions and its worker processes)."""

from __future__ import annotations

import signal
import traceback

from service.envs.user_sim import UserSimulatorError

# Exceptions of env code that are infrastructure (the user simulator's endpoint, a hung call), not
# the policy's doing: the runner fails the episode (not trained on) instead of aborting it.
INFRASTRUCTURE_EXCEPTIONS: tuple[type[Exception], ...] = (UserSimulatorError, TimeoutError)


class EnvHostError(Exception):
    """Base of the errors EnvHost raises."""


class EnvNotFound(EnvHostError, LookupError):
    """An unknown environment name or split."""


class EnvError(EnvHostError):
    """Environment code raised: the original exception's type, message and traceback, as text
    (it crossed a process boundary, and its class may not be importable on this side), and
    whether it is `infrastructure` (see INFRASTRUCTURE_EXCEPTIONS)."""

    def __init__(
        self, exc_type: str, message: str, traceback: str = "", infrastructure: bool = False
    ) -> None:
        # The args are the constructor's, so that it pickles (and crosses the process boundary).
        super().__init__(exc_type, message, traceback, infrastructure)
        self.exc_type = exc_type
        self.message = message
        self.traceback = traceback
        self.infrastructure = infrastructure

    def __str__(self) -> str:
        return f"{self.exc_type}: {self.message}"

    @staticmethod
    def from_exception(exc: BaseException) -> EnvError:
        if isinstance(exc, EnvError):
            return exc
        exc_type = type(exc)
        name = exc_type.__qualname__
        if exc_type.__module__ not in ("builtins", "__main__"):
            name = f"{exc_type.__module__}.{name}"
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        return EnvError(name, str(exc), text, isinstance(exc, INFRASTRUCTURE_EXCEPTIONS))


class EnvCallTimeout(EnvError):
    """An env call did not return within the host's call timeout (or an earlier one of its session
    did not): infrastructure. The call may still be running; the session is abandoned."""

    def __init__(self, message: str) -> None:
        super().__init__("TimeoutError", message, infrastructure=True)

    def __reduce__(self) -> tuple[type[EnvCallTimeout], tuple[str]]:
        return type(self), (self.message,)


class EnvWorkerCrashed(EnvHostError):
    """The worker process an episode was pinned to died; the episode's environment is gone."""

    what = "env worker crashed"  # how the episode's error opens (remote envs name their server)


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
