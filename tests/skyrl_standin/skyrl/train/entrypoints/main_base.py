"""SkyRL's BasePPOExp (its get_generator override point) and the part of its trainer's step that
meets the generator: generate, the logged rollout metrics, validation, per-token rewards, GRPO."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np

from skyrl.train.generators.base import GeneratorInput, GeneratorInterface
from skyrl.train.generators.utils import prepare_generator_input
from skyrl.train.utils.trainer_utils import validate_generator_output


def compute_grpo_outcome_advantage(
    scores: list[float], uids: list[str], epsilon: float = 1e-6
) -> list[float]:
    by_uid: dict[str, list[float]] = defaultdict(list)
    for score, uid in zip(scores, uids, strict=True):
        by_uid[uid].append(score)
    mean = {k: float(np.mean(v)) if len(v) > 1 else 0.0 for k, v in by_uid.items()}
    std = {k: float(np.std(v, ddof=1)) if len(v) > 1 else 1.0 for k, v in by_uid.items()}
    return [(s - mean[u]) / (std[u] + epsilon) for s, u in zip(scores, uids, strict=True)]


class RayPPOTrainer:
    def __init__(self, cfg: Any, generator: GeneratorInterface) -> None:
        self.cfg = cfg
        self.generator = generator
        self.global_step = 1
        self.all_metrics: dict[str, Any] = {}

    async def generate(self, input_batch: GeneratorInput) -> Any:
        generator_output = await self.generator.generate(input_batch)
        if generator_output["rollout_metrics"] is not None:
            self.all_metrics.update(generator_output["rollout_metrics"])
        generator_output.pop("rollout_metrics", None)
        validate_generator_output(len(input_batch["prompts"]), generator_output, step_wise=False)
        return generator_output

    async def generation_step(
        self, rand_prompts: list[dict[str, Any]], phase: str = "train"
    ) -> tuple[Any, list[str]]:
        generator_input, uids = prepare_generator_input(
            rand_prompts,
            self.cfg.generator.n_samples_per_prompt,
            self.cfg.generator.sampling_params,
            self.cfg.environment.env_class,
            phase,
            self.global_step,
        )
        generator_output = await self.generate(generator_input)
        per_token_rewards = []
        for reward, response in zip(
            generator_output["rewards"], generator_output["response_ids"], strict=True
        ):
            per_token_reward = [0.0] * len(response)
            per_token_reward[-1] = float(reward)
            per_token_rewards.append(per_token_reward)
        generator_output["rewards"] = per_token_rewards
        generator_output["advantages"] = compute_grpo_outcome_advantage(
            [sum(rewards) for rewards in per_token_rewards], uids
        )
        return generator_output, uids


class BasePPOExp:
    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg

    def get_generator(self, cfg: Any, tokenizer: Any, inference_engine_client: Any) -> GeneratorInterface:
        raise NotImplementedError("SkyRLGymGenerator: not in the stand-in")

    def get_trainer(self, tokenizer: Any) -> RayPPOTrainer:
        return RayPPOTrainer(self.cfg, self.get_generator(self.cfg, tokenizer, None))
