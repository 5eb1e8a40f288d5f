"""GET /envs: the environments this service can run; GET /model: the model it expects."""

from __future__ import annotations

from fastapi import APIRouter

from service.api.deps import ServicesDep
from service.api.schemas import EnvOut, ModelOut
from service.loop.toolcalls import PARSERS

router = APIRouter(tags=["envs"])


@router.get("/envs", operation_id="list_envs", response_model=list[EnvOut])
async def list_envs(services: ServicesDep) -> list[EnvOut]:
    """Environment names for POST /episodes, with their splits and task counts."""
    return [
        EnvOut(
            name=spec.name,
            description=spec.description,
            splits=dict(spec.splits),
            unavailable=dict(spec.unavailable),
            judged_tasks={split: len(tasks) for split, tasks in spec.judged_tasks.items() if tasks},
        )
        for spec in services.envs.values()
    ]


@router.get("/model", operation_id="get_model", response_model=ModelOut)
async def model(services: ServicesDep) -> ModelOut:
    """The tokenizer episodes are rendered with and the tool-call format their turns are parsed in."""
    return ModelOut(
        tokenizer_path=services.settings.tokenizer_path,
        tool_call_format=services.tool_call_format,
        tool_call_formats=sorted(PARSERS),
    )
