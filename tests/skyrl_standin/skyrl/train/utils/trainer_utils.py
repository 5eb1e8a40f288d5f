"""skyrl.train.utils.trainer_utils.validate_generator_output (non-step-wise), as SkyRL has it."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)


def validate_generator_output(num_prompts: int, generator_output: Any, step_wise: bool = False) -> None:
    if len(generator_output["response_ids"]) <= 0:
        raise RuntimeError("No outputs generated")
    num_responses = len(generator_output["response_ids"])
    num_prompt_tokens = len(generator_output["prompt_token_ids"])
    if not step_wise:
        assert num_prompts == num_responses, (
            f"Mismatch between prompts ({num_prompts}) and responses ({num_responses})"
        )
    assert num_responses == num_prompt_tokens
    for key in generator_output:
        if isinstance(generator_output[key], list) and key in [
            "response_ids", "loss_masks", "rewards", "rollout_logprobs", "stop_reasons", "trajectory_ids",
            "rollout_expert_indices", "is_last_step", "pixel_values", "image_grid_thw",
        ]:  # fmt: skip
            assert len(generator_output[key]) == len(generator_output["response_ids"]), key
    for i, (response_ids, loss_masks, rewards) in enumerate(
        zip(
            generator_output["response_ids"],
            generator_output["loss_masks"],
            generator_output["rewards"],
            strict=False,
        )
    ):
        assert len(response_ids) == len(loss_masks), f"sample {i}"
        if isinstance(rewards, list):
            assert len(rewards) == len(response_ids), f"sample {i}"
        if generator_output["rollout_logprobs"]:
            assert len(response_ids) == len(generator_output["rollout_logprobs"][i]), f"sample {i}"
    if np.concatenate(generator_output["loss_masks"]).sum() == 0:
        logger.warning(
            "All outputs are loss masked, which may lead to NaN loss, please check your generation logic!!"
        )
    rewards = generator_output["rewards"]
    if isinstance(rewards[0], list):
        assert all(isinstance(reward, list) for reward in rewards)
    else:
        assert all(not isinstance(reward, list) for reward in rewards)
