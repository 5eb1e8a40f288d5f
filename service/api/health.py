"""Liveness (/health), readiness (/ready) and Prometheus metrics (/metrics)."""

from __future__ import annotations

from fastapi import APIRouter, Response

from service.api.deps import ServicesDep
from service.api.errors import DatabaseUnavailable, NotReady, responses
from service.api.schemas import HealthOut, ReadyOut
from service.app_state import Services
from service.envs.remote.opener import RemoteEnvs
from service.loop.driven import DrivingRunner
from service.loop.runner import EpisodeRunner
from service.metrics import PROMETHEUS_MEDIA_TYPE
from service.storage.batches import status_counts

router = APIRouter(tags=["operations"])


async def health(services: ServicesDep) -> HealthOut:
    """Liveness: 200 while the process serves, answered from memory (no query, whatever the load).
    `database` is what this process last saw of the database; /ready asks it."""
    return HealthOut(status="ok", database=services.database.status.describe())


async def ready(services: ServicesDep) -> ReadyOut:
    """200 when the database and the SGLang engine both answer and generation is not paused
    (POST /engine/pause); 503 otherwise."""
    database = await services.database.check()
    engine = "ok" if await services.engine.health() else f"unreachable: {services.settings.sglang_url}"
    if database != "ok" or engine != "ok":
        raise NotReady(f"not ready: database {database}; engine {engine}")
    if (paused := await services.pause.paused()) is not None:
        raise NotReady(f"not ready: {paused}")
    return ReadyOut(ready=True, database=database, engine=engine, env_servers=env_servers(services))


def env_servers(services: Services) -> dict[str, str]:
    """Each remote env server's state ("ok" or "down: why"), where this process runs episodes."""
    runner = services.worker.runner if services.worker is not None else None
    if isinstance(runner, DrivingRunner):  # agent-driven envs aside, its loop runs the rest
        runner = runner.inner
    envs = runner.envs if isinstance(runner, EpisodeRunner) else None
    return envs.servers() if isinstance(envs, RemoteEnvs) else {}


# HEAD as GET (the server sends no body), for probes that use it; each method its own operation.
for method in ("GET", "HEAD"):
    suffix = "" if method == "GET" else "_head"
    router.add_api_route(
        "/health", health, methods=[method], operation_id=f"health{suffix}", response_model=HealthOut
    )
    router.add_api_route(
        "/ready",
        ready,
        methods=[method],
        operation_id=f"ready{suffix}",
        response_model=ReadyOut,
        responses=responses(NotReady),
    )


@router.get(
    "/metrics",
    operation_id="metrics",
    response_class=Response,
    responses={
        200: {"content": {PROMETHEUS_MEDIA_TYPE: {"schema": {"type": "string"}}}},
        **responses(DatabaseUnavailable),
    },
)
async def metrics(services: ServicesDep) -> Response:
    """Prometheus text format: episodes by status, turns, tokens, latencies, queue depth, in flight."""
    async with services.database.reader() as session:
        counts = await status_counts(session)
    running = len(services.worker.running) if services.worker is not None else 0
    paused = await services.pause.paused() is not None
    body = services.metrics.render(counts, running, services.engine.inflight, paused=paused)
    return Response(body, media_type=PROMETHEUS_MEDIA_TYPE)
