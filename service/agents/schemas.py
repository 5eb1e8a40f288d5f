"""The bodies of the endpoints every external agent shares, whatever protocol it speaks."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, Field

from service.api.schemas import REQUEST_CONFIG
from service.api.values import Label, field_error, storable_json


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
    status: str = Field(description="As it ended: `failed` for an episode that made no call.")


def known_type(types: tuple[str, ...], what: str, *, untyped: str | None = None) -> BeforeValidator:
    """The validator, before a union tagged by `type`, that refuses a type not in `types` naming
    the `type` field (pydantic's own error names only the object); `untyped`: the type of an object
    sent without one."""

    def check(value: Any) -> Any:
        if isinstance(value, dict) and untyped is not None and "type" not in value:
            return {**value, "type": untyped}
        if isinstance(value, dict) and value.get("type") not in types:
            message = f"{what}'s type is one of {', '.join(types)}"
            raise field_error(["type"], "union_tag_invalid", message, value)
        return value

    return BeforeValidator(check)
