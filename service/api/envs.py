"""GET /envs: the environments this service can run; GET /model: the model it expects."""

from __future__ import annotations

from fastapi import APIRouter

from service.api.deps import ServicesDep
from service.api.schemas import EnvOut, ModelOut
from service.loop.toolcalls import PARSERS
from service.records import EXTERNAL_ENV

router = APIRouter(tags=["envs"])


@router.get("/envs", operation_id="list_envs", response_model=list[EnvOut])
async def list_envs(services: ServicesDep) -> list[EnvOut]:
    """Environment names for POST /episodes, with their splits and task counts; last `external`,
    whose episodes external agents play (its tasks and splits are the caller's labels)."""
    return [
        EnvOut(
            name=spec.name,
            description=spec.description,
            splits=dict(spec.splits),
            unavailable=dict(spec.unavailable),
            judged_tasks={split: len(tasks) for split, tasks in spec.judged_tasks.items() if tasks},
            train_split=spec.train_split,
            source=spec.source,
        )
        for spec in services.envs.values()
    ] + [EXTERNAL]


EXTERNAL = EnvOut(
    name=EXTERNAL_ENV,
    description="Episodes that agents written against the OpenAI API play through their own endpoint "
    "(POST /episodes answers each one's base_url and api_key); task_indices and task_split are the "
    "caller's labels.",
    splits={},
    unavailable={},
    judged_tasks={},
)


@router.get("/model", operation_id="get_model", response_model=ModelOut)
async def model(services: ServicesDep) -> ModelOut:
    """The tokenizer episodes are rendered with and the tool-call format their turns are parsed in."""
    return ModelOut(
        tokenizer_path=services.settings.tokenizer_path,
        tool_call_format=services.tool_call_format,
        tool_call_formats=sorted(PARSERS),
    )
