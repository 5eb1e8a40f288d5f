"""skyrl.train.generators.utils.prepare_generator_input, as SkyRL has it."""

from __future__ import annotations

import copy
from typing import Any

from skyrl.train.generators.base import BatchMetadata, GeneratorInput, TrajectoryID


def prepare_generator_input(
    prompts: list[Any],
    n_samples_per_prompt: int,
    sampling_params: dict[str, Any],
    default_env_class: str,
    training_phase: str,
    global_step: int,
) -> tuple[GeneratorInput, list[str]]:
    all_prompts = [prompt["prompt"] for prompt in prompts for _ in range(n_samples_per_prompt)]
    all_envs = [
        prompt["env_class"] if prompt["env_class"] is not None else default_env_class
        for prompt in prompts
        for _ in range(n_samples_per_prompt)
    ]
    env_extras = [
        copy.deepcopy(prompt["env_extras"]) for prompt in prompts for _ in range(n_samples_per_prompt)
    ]
    trajectory_ids = []
    uids = []
    for prompt in prompts:
        uid: str = prompt["uid"]
        for repetition_id in range(n_samples_per_prompt):
            trajectory_ids.append(TrajectoryID(instance_id=uid, repetition_id=repetition_id))
            uids.append(uid)
    generator_input: GeneratorInput = {
        "prompts": all_prompts,
        "env_classes": all_envs,
        "env_extras": env_extras,
        "sampling_params": sampling_params,
        "trajectory_ids": trajectory_ids,
        "batch_metadata": BatchMetadata(global_step=global_step, training_phase=training_phase),  # type: ignore[arg-type]
    }
    return generator_input, uids
