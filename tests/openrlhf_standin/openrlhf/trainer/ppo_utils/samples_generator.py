"""openrlhf/trainer/ppo_utils/samples_generator.py: the sampling params the generator sends and
how it turns an executor's result into an Experience; numpy for torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class SamplingParams:
    """vLLM's SamplingParams, the fields _dispatch_prompts_to_vllm sets."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int | None = None
    min_tokens: int = 1
    skip_special_tokens: bool = False
    logprobs: int | None = None


@dataclass
class Experience:
    sequences: np.ndarray
    attention_mask: np.ndarray
    action_mask: np.ndarray
    rollout_log_probs: np.ndarray | None
    prompts: list[Any]
    labels: list[Any]
    rewards: np.ndarray | None
    scores: np.ndarray | None
    response_length: np.ndarray
    truncated: np.ndarray
    total_length: np.ndarray
    info: dict[str, np.ndarray] = field(default_factory=dict)


def _process_response_into_experience(response: dict[str, Any], max_len: int = 2048) -> Experience:
    tokenized_observation = list(response["observation_tokens"])
    tokenized_ranges = response["action_ranges"]
    reward_val = response.get("reward", None)
    score_val = response.get("scores", None)

    sequences = np.array(tokenized_observation, dtype=np.int64)
    attention_mask = np.ones(len(tokenized_observation), dtype=np.int64)
    action_mask = np.zeros_like(attention_mask)
    for start, end in tokenized_ranges:
        action_mask[start:end] = 1

    sequences = sequences[:max_len]
    attention_mask = attention_mask[:max_len]
    action_mask = action_mask[1:max_len]
    if response["rollout_log_probs"] is not None:
        rollout_log_probs = np.array(response["rollout_log_probs"][1:max_len])
    else:
        rollout_log_probs = None

    ones_indices = np.flatnonzero(action_mask)
    response_length = int(ones_indices[-1] - ones_indices[0] + 1) if len(ones_indices) else 0
    total_length = float(attention_mask.sum())
    is_clipped = total_length >= max_len
    info: dict[str, np.ndarray] = {"response_clip_ratio": np.array([is_clipped])}
    if reward_val is not None:
        info["reward"] = np.array([reward_val])
    if score_val is not None:
        info["score"] = np.array([score_val])
    for key, value in response.get("extra_logs", {}).items():
        info[key] = np.array([value])
    return Experience(
        sequences=sequences[None, :],
        attention_mask=attention_mask[None, :],
        action_mask=action_mask[None, :],
        rollout_log_probs=rollout_log_probs[None, :] if rollout_log_probs is not None else None,
        prompts=[response["prompt"]],
        labels=[response["label"]],
        rewards=np.array([reward_val]) if reward_val is not None else None,
        scores=np.array([score_val]) if score_val is not None else None,
        response_length=np.array([response_length]),
        truncated=np.array([response.get("truncated", False)]),
        total_length=np.array([total_length]),
        info=info,
    )
