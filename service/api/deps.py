"""Dependencies of the routes: the app's services and one transaction per request."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import Depends, Request
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
