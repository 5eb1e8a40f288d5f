"""What the caller's API key opens (API_KEYS: everything; API_PROJECTS: a project's batches), as
dependencies of the routes: the caller's scope, a batch id in it, an admin's operation.

A batch or episode outside the caller's scope is answered exactly as one that does not exist (a
404 with the same message), so that other projects' ids cannot be probed: batch ids are judged by
their prefix before any read, episodes are read with the scope in the query, and lists are
filtered in SQL. The key itself was checked by the middleware (401)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path, Request

from service.api.auth import bearer_key
from service.api.deps import ServicesDep
from service.api.errors import Forbidden, NotFound, Unauthorized, responses
from service.api.schemas import BATCH_ID_PATTERN, AccessOut
from service.config import ADMIN, Access

router = APIRouter(tags=["access"])


async def caller_access(request: Request, services: ServicesDep) -> Access:
    """The scope of the request's key; an admin's when no key is set (an open service)."""
    table = services.settings.key_table
    if table.open:
        return ADMIN
    access = table.lookup(bearer_key(dict(request.scope["headers"]).get(b"authorization", b"")))
    if access is None:  # the middleware refused it already: a route reached another way
        raise Unauthorized("missing or invalid API key: send 'Authorization: Bearer <key>'")
    return access


AccessDep = Annotated[Access, Depends(caller_access)]


async def scoped_batch_id(
    batch_id: Annotated[str, Path(max_length=128, pattern=BATCH_ID_PATTERN)], access: AccessDep
) -> str:
    """The path's batch id, if the caller's scope holds it; else the 404 of a batch that does not
    exist, answered before any read."""
    if not access.owns(batch_id):
        raise NotFound(f"no batch {batch_id!r}")
    return batch_id


BatchId = Annotated[str, Depends(scoped_batch_id)]


async def admin_only(access: AccessDep) -> None:
    """A 403 for a project key: the service's own controls are an admin's (API_KEYS)."""
    if not access.admin:
        raise Forbidden(
            f"this operation is an admin key's (API_KEYS); the key of project {access.project!r} "
            "opens its own batches only"
        )


@router.get("/access", operation_id="get_access", response_model=AccessOut, responses=responses(Unauthorized))
async def get_access(access: AccessDep) -> AccessOut:
    """What the caller's key opens: every batch (an admin), or one project's, whose batch ids start
    with `batch_prefix`: a client makes its batch ids with it."""
    return AccessOut(admin=access.admin, project=access.project, batch_prefix=access.batch_prefix)
