"""Dependencies of the routes: the app's services, one transaction per request, and the check
that a request's query names only parameters its route takes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import Depends, Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from sqlalchemy.ext.asyncio import AsyncSession

from service.app_state import Services


def get_services(request: Request) -> Services:
    services: Services = request.state.services
    return services


ServicesDep = Annotated[Services, Depends(get_services)]


async def get_read_session(services: ServicesDep) -> AsyncIterator[AsyncSession]:
    """A read-only session for the request (GET never changes state)."""
    async with services.database.reader() as session:
        yield session


ReadSessionDep = Annotated[AsyncSession, Depends(get_read_session)]


def _query_names(route: APIRoute) -> frozenset[str]:
    """The query parameters of the route and of its dependencies."""
    names: set[str] = set()
    pending = [route.dependant]
    while pending:
        dependant = pending.pop()
        names.update(param.alias for param in dependant.query_params)
        pending.extend(dependant.dependencies)
    return frozenset(names)


def refuse_unknown_query_parameters(request: Request) -> None:
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
