"""skyrl.train.generators.base: the generator's types (torch fields left out)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Literal, TypedDict

TrainingPhase = Literal["train", "eval"]


@dataclass
class TrajectoryID:
    instance_id: str
    repetition_id: int

    def to_string(self) -> str:
        return f"{self.instance_id}_{self.repetition_id}"


@dataclass
class BatchMetadata:
    global_step: int
    training_phase: TrainingPhase


class GeneratorInput(TypedDict):
    prompts: list[Any]
    env_classes: list[str]
    env_extras: list[dict[str, Any]] | None
    sampling_params: dict[str, Any] | None
    trajectory_ids: list[TrajectoryID] | None
    batch_metadata: BatchMetadata | None


class GeneratorOutput(TypedDict):
    prompt_token_ids: list[list[int]]
    response_ids: list[list[int]]
    rewards: list[float] | list[list[float]]
    loss_masks: list[list[int]]
    stop_reasons: list[str] | None
    rollout_metrics: dict[str, Any] | None
    rollout_logprobs: list[list[float]] | None
    trajectory_ids: list[TrajectoryID] | None
    trajectory_generation_times: list[float] | None
    trajectory_time_splits: dict[str, list[float]] | None
    rollout_expert_indices: Any
    is_last_step: list[bool] | None
    env_metrics: list[dict[str, Any]] | None
    pixel_values: Any
    image_grid_thw: Any


class GeneratorInterface(ABC):
    @abstractmethod
    async def generate(self, input_batch: GeneratorInput) -> GeneratorOutput:
        raise NotImplementedError
