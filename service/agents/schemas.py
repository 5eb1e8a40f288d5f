"""The bodies of the endpoints every external agent shares, whatever protocol it speaks."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, Field

from service.api.schemas import REQUEST_CONFIG
from service.api.values import Label, storable_json


class FinishEpisode(BaseModel):
    model_config = REQUEST_CONFIG

    status: Literal["completed", "truncated", "aborted", "failed"] = "completed"
    reward: float | None = None
    info: Annotated[dict[str, Any], AfterValidator(storable_json)] = Field(
        default_factory=dict, description="Merged into the episode's info."
    )
    error: Label | None = Field(default=None, max_length=10_000)


class FinishedOut(BaseModel):
    episode_id: str
    status: str
