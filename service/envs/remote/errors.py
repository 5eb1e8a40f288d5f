"""The errors of remote env servers, as the episode runner classes them."""

from __future__ import annotations

from service.envs.errors import EnvError, EnvWorkerCrashed


class EnvServerDown(EnvWorkerCrashed):
    """The env server an episode was placed on is unreachable, closed its session, or no server of
    the pool could take the episode: infrastructure. The runner fails the episode as retryable
    (re-run within the attempt budget), never with a reward. The message names the server and
    how it failed, as the episode's error shows it."""

    what = "env server failed"
    how = ""  # what the server did ("refused the connection during reset"), where known
    kind = "connect"  # the pool's error kind (pool.ERROR_KINDS) of the failed call


class EnvServerTimeout(EnvServerDown):
    """A call to an env server did not answer within its timeout: infrastructure, re-run like a
    server that is down (the call may have changed the server's state, so it is never re-sent)."""


class EnvServerError(EnvError):
    """The env server answered a call with an error of the environment's own code (its reset or
    step raised): the episode is aborted with it, as a local env's exception would."""

    def __init__(self, message: str) -> None:
        super().__init__("EnvServerError", message)

    def __reduce__(self) -> tuple[type[EnvServerError], tuple[str]]:
        return type(self), (self.message,)


def describe_failure(kind: str, error: BaseException, timeout_seconds: float) -> str:
    """What the episode's error says of a failed call: refused / not reached / timed out / closed."""
    if kind == "timeout":
        return f"did not answer within {timeout_seconds:g} s"
    if kind == "closed":
        return f"closed the connection ({type(error).__name__}: {error})"
    if kind == "capacity":
        return f"had no room for a session ({error})"
    if kind == "connect":
        seen: BaseException | None = error
        while seen is not None:
            if isinstance(seen, ConnectionRefusedError) or "Connect call failed" in str(seen):
                return "refused the connection"
            seen = seen.__cause__ or seen.__context__
        return f"could not be connected to ({type(error).__name__}: {error})"
    return f"answered with an error ({error})"


def server_failure(
    server_url: str, env: str, doing: str, kind: str, error: BaseException, timeout_seconds: float
) -> EnvServerDown:
    """The infrastructure error of a call to `server_url` that failed as `kind`."""
    cls = EnvServerTimeout if kind == "timeout" else EnvServerDown
    how = f"{describe_failure(kind, error, timeout_seconds)} during {doing}"
    failure = cls(f"{server_url} ({env}) {how}")
    failure.how = how
    failure.kind = kind
    return failure
