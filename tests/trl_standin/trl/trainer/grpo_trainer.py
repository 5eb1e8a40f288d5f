"""The part of TRL's GRPOTrainer that meets a rollout_func, numpy for torch."""

from __future__ import annotations

import copy
import warnings
from collections import defaultdict
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np


@dataclass
class GRPOConfig:
    output_dir: str = "trainer_output"
    num_generations: int = 8
    num_generations_eval: int | None = None
    max_completion_length: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    mask_truncated_completions: bool = False


def pad(rows: list[list[Any]], value: Any, side: str, dtype: Any) -> np.ndarray:
    width = max(len(row) for row in rows)
    out = np.full((len(rows), width), value, dtype=dtype)
    for i, row in enumerate(rows):
        if row:
            if side == "left":
                out[i, width - len(row) :] = row
            else:
                out[i, : len(row)] = row
    return out


def nanstd(values: np.ndarray, axis: int | None = None) -> np.ndarray:
    """TRL's nanstd: the unbiased std over the non-NaN values."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.sqrt(np.nanvar(values, axis=axis, ddof=1))


class GRPOTrainer:
    def __init__(
        self, model: Any, reward_funcs: Any, args: GRPOConfig, processing_class: Any, rollout_func: Any
    ) -> None:
        self.args = args
        self.model = SimpleNamespace(training=True, name=model)
        self.reward_funcs = reward_funcs if isinstance(reward_funcs, list) else [reward_funcs]
        self.reward_weights = np.ones(len(self.reward_funcs))
        self.processing_class = processing_class
        self._tokenizer = processing_class
        self.rollout_func = rollout_func
        self.num_generations = args.num_generations
        self.num_generations_eval = args.num_generations_eval or self.num_generations
        self.max_completion_length = args.max_completion_length
        self.temperature, self.top_p, self.top_k = args.temperature, args.top_p, args.top_k
        self.min_p, self.repetition_penalty = args.min_p, args.repetition_penalty
        self.mask_truncated_completions = args.mask_truncated_completions
        self.state = SimpleNamespace(global_step=0)
        self.accelerator = SimpleNamespace(process_index=0)
        self._metrics: dict[str, defaultdict[str, list[float]]] = {
            "train": defaultdict(list),
            "eval": defaultdict(list),
        }

    def _generate(self, prompts: list[Any]) -> tuple[Any, ...]:
        prompts = copy.deepcopy(prompts)
        output = self.rollout_func(prompts, self)
        required_keys = {"prompt_ids", "completion_ids", "logprobs"}
        missing_keys = required_keys - output.keys()
        if missing_keys:
            raise ValueError(f"rollout_func must return keys {sorted(missing_keys)} in its output dict.")
        extra_fields = {k: v for k, v in output.items() if k not in required_keys}
        prompt_ids, completion_ids, logprobs = (
            output["prompt_ids"],
            output["completion_ids"],
            output["logprobs"],
        )
        tool_mask = extra_fields.pop("env_mask", None)
        eos_and_pad = [self._tokenizer.eos_token_id, self._tokenizer.pad_token_id]
        is_truncated = [ids[-1] not in eos_and_pad for ids in completion_ids]  # TRL's clipped_ratio
        mode = "train" if self.model.training else "eval"
        self._metrics[mode]["completions/clipped_ratio"].append(float(np.mean(is_truncated)))
        return prompt_ids, completion_ids, tool_mask, logprobs, extra_fields

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        mode = "train" if self.model.training else "eval"
        prompts = [x["prompt"] for x in inputs]
        prompt_ids_list, completion_ids_list, tool_mask_list, logps_list, extra_fields = self._generate(
            prompts
        )
        assert len(prompt_ids_list) == len(completion_ids_list) == len(logps_list) == len(prompts)
        pad_id = self._tokenizer.pad_token_id
        prompt_ids = pad(prompt_ids_list, pad_id, "left", np.int64)
        prompt_mask = pad([[1] * len(ids) for ids in prompt_ids_list], 0, "left", np.int64)
        completion_ids = pad(completion_ids_list, pad_id, "right", np.int64)
        completion_mask = pad([[1] * len(ids) for ids in completion_ids_list], 0, "right", np.int64)
        sampling_logps = pad(logps_list, 0.0, "right", np.float32)
        tool_mask = pad(tool_mask_list, 1, "right", np.int64) if tool_mask_list is not None else None
        if self.mask_truncated_completions:
            eos_and_pad = [self._tokenizer.eos_token_id, pad_id]
            is_truncated = np.array([ids[-1] not in eos_and_pad for ids in completion_ids_list])
            completion_mask = completion_mask * (~is_truncated)[:, None].astype(int)
            if tool_mask is not None:
                tool_mask = tool_mask * (~is_truncated)[:, None].astype(int)
        loss_mask = completion_mask if tool_mask is None else completion_mask * tool_mask
        for i, inp in enumerate(inputs):
            for key, values in extra_fields.items():
                if isinstance(values, list) and i < len(values):
                    inp[key] = values[i]
                elif not isinstance(values, list):
                    inp[key] = values
        rewards_per_func = self._calculate_rewards(inputs, prompts, completion_ids_list)
        num_generations = self.num_generations if mode == "train" else self.num_generations_eval
        unscorable_mask = np.isnan(rewards_per_func).all(axis=1)
        rewards = np.nansum(rewards_per_func * self.reward_weights[None, :], axis=1)
        rewards[unscorable_mask] = np.nan
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a group of unscorable rows: NaN
            mean_grouped = np.nanmean(rewards.reshape(-1, num_generations), axis=1)
        mean_grouped = np.repeat(mean_grouped, num_generations)
        std_grouped = np.repeat(nanstd(rewards.reshape(-1, num_generations), axis=1), num_generations)
        advantages = np.nan_to_num((rewards - mean_grouped) / (std_grouped + 1e-4), nan=0.0)
        return {
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "completion_ids": completion_ids,
            "completion_mask": completion_mask,
            "tool_mask": tool_mask,
            "loss_mask": loss_mask,
            "sampling_per_token_logps": sampling_logps,
            "advantages": advantages,
            "rewards": rewards,
            "inputs": inputs,
        }

    def _calculate_rewards(
        self, inputs: list[dict[str, Any]], prompts: list[Any], completion_ids: list[Any]
    ) -> np.ndarray:
        rewards_per_func = np.zeros((len(prompts), len(self.reward_funcs)), dtype=np.float32)
        keys = [key for key in inputs[0] if key not in ["prompt", "completion", "completion_ids"]]
        reward_kwargs = {key: [example[key] for example in inputs] for key in keys}
        reward_kwargs["trainer_state"] = self.state
        completions = [str(ids) for ids in completion_ids]
        for i, reward_func in enumerate(self.reward_funcs):
            output = reward_func(
                prompts=prompts, completions=completions, completion_ids=completion_ids, **reward_kwargs
            )
            rewards_per_func[:, i] = [np.nan if reward is None else reward for reward in output]
        return rewards_per_func


def repeat_sampler(rows: list[dict[str, Any]], mini_repeat_count: int) -> list[dict[str, Any]]:
    """TRL's RepeatSampler order: each dataset row `mini_repeat_count` times, consecutively."""
    return [dict(row) for row in rows for _ in range(mini_repeat_count)]
