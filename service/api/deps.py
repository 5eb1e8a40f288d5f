"""What the routes share: the app's services, long-polls, and the check that a request's query
names only parameters its route takes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Annotated

from fastapi import Depends, Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute

from service.app_state import Services


# The dependencies are coroutines: FastAPI runs a plain function's in a thread pool, a thread hop
# per request (5% of an external agent's call).
async def get_services(request: Request) -> Services:
    services: Services = request.state.services
    return services


ServicesDep = Annotated[Services, Depends(get_services)]


WAIT_POLL_SECONDS = 1.0  # how often a long-poll re-reads the database (other processes' results)
# A long-poll woken by this process's results re-reads at most this often: at 2,000 episodes in
# flight results are stored every few milliseconds, and a re-read after each (a count of the
# batch's episodes by status) was 2-3% of the service's CPU. Results stored meanwhile are read together.
RECHECK_SECONDS = 0.05


LONG_POLL_CUT = ": at most MAX_LONG_POLL_SECONDS (a setting); a longer wait is cut to it."  # ?wait= docs


async def long_poll(services: Services, wait: float, done: Callable[[], Awaitable[bool]]) -> None:
    """Returns once `done()` (a database read) is true, or after `wait` seconds (at most
    MAX_LONG_POLL_SECONDS), or when the server stops. It asks again whenever this process stores a
    result (at most every RECHECK_SECONDS), and every WAIT_POLL_SECONDS for the other processes'."""
    deadline = time.monotonic() + min(wait, services.settings.max_long_poll_seconds)
    while not await done():
        asked = time.monotonic()
        if asked >= deadline or services.shutting_down.is_set():
            return
        await services.results.wait(min(deadline - asked, WAIT_POLL_SECONDS))
        pause = min(asked + RECHECK_SECONDS, deadline) - time.monotonic()
        if pause > 0 and not services.shutting_down.is_set():
            await asyncio.sleep(pause)


def _query_names(route: APIRoute) -> frozenset[str]:
    """The query parameters of the route and of its dependencies."""
    names: set[str] = set()
    pending = [route.dependant]
    while pending:
        dependant = pending.pop()
        names.update(param.alias for param in dependant.query_params)
        pending.extend(dependant.dependencies)
    return frozenset(names)


async def refuse_unknown_query_parameters(request: Request) -> None:
    """A query parameter the route does not take is a 422 naming it: a typo (`include_token=true`)
    must not silently change the answer."""
    route = request.scope.get("route")
    if not isinstance(route, APIRoute):
        return
    known = _query_names(route)
    unknown = [name for name in request.query_params if name not in known]
    if unknown:
        takes = ", ".join(sorted(known)) or "none"
        raise RequestValidationError(
            [
                {
                    "type": "extra_forbidden",
                    "loc": ("query", name),
                    "msg": f"unknown query parameter (this route takes: {takes})",
                    "input": request.query_params[name],
                }
                for name in unknown
            ]
        )
