from __future__ import annotations

from typing import Any

from pydantic import BaseModel

RESPOND_ACTION_NAME = "respond"
RESPOND_ACTION_FIELD_NAME = "content"


class Action(BaseModel):
    name: str
    kwargs: dict[str, Any]


class Task(BaseModel):
    user_id: str
    actions: list[Action]
    instruction: str
    outputs: list[str]


class RewardOutputInfo(BaseModel):
    r_outputs: float
    outputs: dict[str, bool]


class RewardActionInfo(BaseModel):
    r_actions: float
    gt_data_hash: str


class RewardResult(BaseModel):
    reward: float
    info: RewardOutputInfo | RewardActionInfo
    actions: list[Action]


class EnvInfo(BaseModel):
    task: Task
    source: str | None = None
    user_cost: float | None = None
    reward_info: RewardResult | None = None


class EnvResponse(BaseModel):
    observation: str
    reward: float
    done: bool
    info: EnvInfo


class EnvResetResponse(BaseModel):
    observation: str
    info: EnvInfo
