"""Liveness (/health), readiness (/ready) and Prometheus metrics (/metrics)."""

from __future__ import annotations

from fastapi import APIRouter, Response
from sqlalchemy import text

from service.api.deps import ServicesDep
from service.api.errors import NotReady, responses
from service.api.schemas import HealthOut, ReadyOut
from service.app_state import Services
from service.metrics import PROMETHEUS_MEDIA_TYPE

router = APIRouter(tags=["operations"])


async def database_state(services: Services) -> str:
    try:
        async with services.database.reader() as session:
            await session.execute(text("SELECT 1"))
    except Exception as error:  # any failure to reach the database is the answer, not a crash
        return f"error: {type(error).__name__}: {error}"[:300]
    return "ok"


@router.get("/health", operation_id="health", response_model=HealthOut)
async def health(services: ServicesDep) -> HealthOut:
    """The process is up (always 200 while it is); `database` says whether the DB answers."""
    return HealthOut(status="ok", database=await database_state(services))


@router.get("/ready", operation_id="ready", response_model=ReadyOut, responses=responses(NotReady))
async def ready(services: ServicesDep) -> ReadyOut:
    """200 when the database and the SGLang engine both answer; 503 otherwise."""
    database = await database_state(services)
    engine = "ok" if await services.engine.health() else f"unreachable: {services.settings.sglang_url}"
    if database != "ok" or engine != "ok":
        raise NotReady(f"not ready: database {database}; engine {engine}")
    return ReadyOut(ready=True, database=database, engine=engine)


@router.get(
    "/metrics",
    operation_id="metrics",
    response_class=Response,
    responses={200: {"content": {PROMETHEUS_MEDIA_TYPE: {"schema": {"type": "string"}}}}},
)
async def metrics(services: ServicesDep) -> Response:
    """Prometheus text format: episodes by status, turns, tokens, latencies, queue depth, in flight."""
    body = await services.metrics.render(services)
    return Response(body, media_type=PROMETHEUS_MEDIA_TYPE)
