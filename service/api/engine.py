"""Control of the SGLang workers behind the service, for trainers around weight updates.

The router does not proxy control calls, so each goes to every worker (SGLANG_WORKER_URLS, or the
router's GET /workers).
"""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, Field

from service.api.access import admin_only
from service.api.deps import ServicesDep
from service.api.errors import Forbidden, NotReady, responses

# The engine serves every project: its controls are an admin key's (a project key: 403).
router = APIRouter(
    prefix="/engine", tags=["engine"], dependencies=[Depends(admin_only)], responses=responses(Forbidden)
)


class PauseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    mode: Literal["abort", "retract", "in_place"] = Field(
        default="retract",
        description="SGLang's pause mode. 'abort' aborts in-flight requests: their turns resume after "
        "/engine/continue from what they sampled. 'retract' and 'in_place' keep them waiting until continue.",
    )


class ControlResult(BaseModel):
    workers: dict[str, str] = Field(description="Worker URL -> 'ok' or the problem.")


class WorkersOut(BaseModel):
    workers: list[str]


def _result(path: str, problems: dict[str, str | None]) -> ControlResult:
    result = ControlResult(workers={url: problem or "ok" for url, problem in problems.items()})
    failed = {url: problem for url, problem in problems.items() if problem is not None}
    if failed:
        raise NotReady(f"{path} failed on {len(failed)} of {len(problems)} workers: {failed}")
    return result


@router.get("/workers", operation_id="engine_workers", response_model=WorkersOut)
async def engine_workers(services: ServicesDep) -> WorkersOut:
    """The workers control calls go to."""
    return WorkersOut(workers=await services.engine.workers())


@router.post(
    "/pause", operation_id="pause_generation", response_model=ControlResult, responses=responses(NotReady)
)
async def pause_generation(body: PauseRequest, services: ServicesDep) -> ControlResult:
    """POST /pause_generation on every worker. Until POST /engine/continue (through any process of
    the service), /ready answers 503 in every process; past MAX_PAUSE_SECONDS, or when this process
    stops first, the service resumes generation itself."""
    return _result("/pause_generation", await services.pause.pause(body.mode))


@router.post(
    "/continue",
    operation_id="continue_generation",
    response_model=ControlResult,
    responses=responses(NotReady),
)
async def continue_generation(services: ServicesDep) -> ControlResult:
    """POST /continue_generation on every worker."""
    result = _result("/continue_generation", await services.engine.resume())
    await services.pause.ended()  # only once every worker took it: else the limit still resumes them
    return result
