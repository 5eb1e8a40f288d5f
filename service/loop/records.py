"""What an episode is asked to do and what it produces; no I/O."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any


class EpisodeStatus(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    COMPLETED = "completed"  # the environment said done
    TRUNCATED = "truncated"  # turn limit, a turn cut at max_new_tokens, or the response-token budget
    ABORTED = "aborted"  # the engine aborted the request, an unparseable tool call, an env error
    FAILED = "failed"  # infrastructure error after retries; `error` says which

    @property
    def finished(self) -> bool:
        return self not in (EpisodeStatus.QUEUED, EpisodeStatus.RUNNING)


FINISHED_STATUSES = frozenset(status for status in EpisodeStatus if status.finished)


@dataclass(frozen=True)
class EpisodeSpec:
    episode_id: str
    attempt: int
    env: str
    task_split: str
    task_index: int
    sampling_params: dict[str, Any]
    max_turns: int
    max_response_tokens: int | None = None


@dataclass
class TurnRecord:
    turn: int
    weight_version: str | None
    finish_reason: dict[str, Any]
    output_tokens: int
    engine_seconds: float
    env_seconds: float = 0.0
    action: str | None = None  # the tool called, "respond", or None when the turn ended the episode
    has_logprobs: bool = True  # False: SGLang sent no logprobs; this turn's are placeholders (0.0)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class EpisodeResult:
    status: EpisodeStatus
    reward: float | None
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    messages: list[dict[str, Any]]
    info: dict[str, Any]
    turns: list[TurnRecord] = field(default_factory=list)
    error: str | None = None
    # An infrastructure failure (engine unreachable, env worker crashed) that another attempt
    # may not meet: the worker re-queues the episode while it has attempts left.
    retryable: bool = False

    @classmethod
    def failed(cls, error: str) -> EpisodeResult:
        return cls(EpisodeStatus.FAILED, None, [], [], [], [], [], {}, error=error)
