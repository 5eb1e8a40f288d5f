"""The errors of remote env servers, as the episode runner classes them."""

from __future__ import annotations

from service.envs.errors import EnvError, EnvWorkerCrashed


class EnvServerDown(EnvWorkerCrashed):
    """The env server an episode was placed on is unreachable, closed its session, or no server of
    the pool could take the episode: infrastructure. The runner fails the episode as retryable
    (re-run within the attempt budget), never with a reward."""


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
