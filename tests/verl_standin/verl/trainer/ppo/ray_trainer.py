"""The part of verl's RayPPOTrainer that meets an agent-loop manager: building it
(`init_workers`) and one step of `fit` from the dataloader's batch to the GRPO advantages."""

from __future__ import annotations

import uuid
from collections import defaultdict
from typing import Any

import numpy as np

from verl.protocol import DataProto
from verl.utils.import_utils import load_class_from_fqn


def compute_grpo_outcome_advantage(
    token_level_rewards: np.ndarray, response_mask: np.ndarray, index: np.ndarray, epsilon: float = 1e-6
) -> np.ndarray:
    """verl/trainer/ppo/core_algos.py, numpy for torch (torch.std is the unbiased std)."""
    scores = token_level_rewards.sum(axis=-1)
    by_id: dict[Any, list[float]] = defaultdict(list)
    for i in range(len(scores)):
        by_id[index[i]].append(float(scores[i]))
    mean = {k: (0.0 if len(v) == 1 else float(np.mean(v))) for k, v in by_id.items()}
    std = {k: (1.0 if len(v) == 1 else float(np.std(v, ddof=1))) for k, v in by_id.items()}
    normalised = np.array(
        [(scores[i] - mean[index[i]]) / (std[index[i]] + epsilon) for i in range(len(scores))]
    )
    return normalised[:, None] * response_mask


class RayPPOTrainer:
    def __init__(self, config: Any) -> None:
        self.config = config
        self.global_steps = 0

    def init_workers(self) -> None:
        manager_class_fqn = self.config.actor_rollout_ref.rollout.get("agent", {}).get(
            "agent_loop_manager_class"
        )
        manager_class = load_class_from_fqn(manager_class_fqn, "AgentLoopManager")
        self.async_rollout_manager = manager_class(
            config=self.config, worker_group=None, rollout_resource_pool=None, rm_resource_pool=None
        )
        self.rollout_replicas = list(self.async_rollout_manager.rollout_replicas)

    def _get_gen_batch(self, batch: DataProto) -> DataProto:
        reward_model_keys = {
            "data_source",
            "reward_model",
            "extra_info",
            "uid",
        } & batch.non_tensor_batch.keys()
        non_tensor_batch_keys_to_pop = set(batch.non_tensor_batch.keys()) - reward_model_keys
        gen_batch = batch.pop(batch_keys=[], non_tensor_batch_keys=list(non_tensor_batch_keys_to_pop))
        gen_batch.non_tensor_batch.update(batch.non_tensor_batch)
        return gen_batch

    def generation_step(self, batch_dict: dict[str, Any]) -> tuple[DataProto, dict[str, float]]:
        """fit's step up to the advantages; returns the batch and timing_raw."""
        self.global_steps += 1
        timing_raw: dict[str, float] = {}
        batch = DataProto.from_single_dict(batch_dict)
        batch.meta_info["temperature"] = self.config.actor_rollout_ref.rollout.temperature
        batch.non_tensor_batch["uid"] = np.array([str(uuid.uuid4()) for _ in range(len(batch))], dtype=object)
        gen_batch = self._get_gen_batch(batch)
        gen_batch.meta_info["global_steps"] = self.global_steps
        n = self.config.actor_rollout_ref.rollout.n
        gen_batch_output = gen_batch.repeat(repeat_times=n, interleave=True)
        gen_batch_output = self.async_rollout_manager.generate_sequences(gen_batch_output)
        timing_raw.update(gen_batch_output.meta_info["timing"])
        gen_batch_output.meta_info.pop("timing", None)
        batch = batch.repeat(repeat_times=n, interleave=True)
        batch = batch.union(gen_batch_output)
        assert "response_mask" in batch.batch
        for multi_modal_input in batch.non_tensor_batch["multi_modal_inputs"]:
            if "image_grid_thw" not in multi_modal_input.keys():
                continue
        batch.batch["token_level_rewards"] = batch.batch["rm_scores"]
        batch.batch["advantages"] = compute_grpo_outcome_advantage(
            batch.batch["token_level_rewards"], batch.batch["response_mask"], batch.non_tensor_batch["uid"]
        )
        return batch, timing_raw
