"""OpenRLHF's agent executor, backed by the rollout service: one flag plugs it in.

    python -m openrlhf.cli.train_ppo_ray --train.agent_func_path examples/openrlhf/agent_func.py ...

(that file is `from rollout_client.openrlhf import AgentExecutor`). Follows OpenRLHF at commit
3c3be6234e0cb353e76bb8019947db9dfe99fca7 (2026-08-13): each vLLM actor loads the file's
`AgentExecutor` (openrlhf/trainer/ray/vllm_engine.py: _load_agent_executor, a subclass of
AgentExecutorBase, built without arguments); `generate_responses` runs a prompt's
`n_samples_per_prompt` samples as `asyncio.gather` of `execute(prompt, label, sampling_params,
max_length, hf_tokenizer, llm_engine, images)`, one call per sample; SamplesGenerator turns each
result into an Experience (openrlhf/trainer/ppo_utils/samples_generator.py:
_process_response_into_experience): `observation_tokens` (prompt + response), `action_ranges`
(the spans trained on), `rollout_log_probs` (one per observation token, read from the second),
`reward`, `scores`, `truncated`, `extra_logs` (scalars, logged per sample), cut at `max_len`.

A prompt's calls start in one turn of the event loop, with one SamplingParams object: they become
one service group (rollout_client.siblings), each call taking its row. The task is the dataset's label
(`--data.label_key` naming a task-index column), else the prompt text as an integer. Sampling
params are vLLM's (temperature, top_p, top_k, max_tokens). Configured by environment variables, as
rollout_client.slime: ROLLOUT_SERVICE_URL, ROLLOUT_ENV, and optionally ROLLOUT_API_KEY,
ROLLOUT_TASK_SPLIT, ROLLOUT_MAX_TURNS, ROLLOUT_RUN_ID. OpenRLHF tells an executor no step: a
group's batch id is the run's, the prompt's hash and its occurrence in this process, and without
ROLLOUT_RUN_ID the run id is new per process (so a restart never takes an earlier step's episodes).

OpenRLHF takes every result as a sample: a failed, aborted or cancelled episode keeps its row with
no action range (no loss) and, as reward and score, the mean of its group's trained rewards (so it
does not move the group's baseline); `extra_logs` flags it (`rollout_service_masked`). A response
longer than `max_length` minus its prompt is cut with its logprobs (`rollout_service_cut`,
`truncated`). The counts so far are in `executor.counts`.

OpenRLHF is imported when AgentExecutor is first used: this module imports without it.
"""

from __future__ import annotations

import uuid
from collections.abc import Hashable
from typing import Any

import numpy as np

from rollout_client.batch import EpisodeArrays
from rollout_client.client import AsyncRolloutClient
from rollout_client.siblings import LoopWaiter, SiblingCalls
from rollout_client.steps import (
    TRAINABLE_STATUSES,
    ServiceConfig,
    StepBatch,
    StepCounts,
    digest,
    response_for_trainer,
    rewards_for_grpo,
    sglang_sampling_params,
    trainer_class,
)

OPENRLHF_COMMIT = "3c3be6234e0cb353e76bb8019947db9dfe99fca7"


def task_of(prompt: Any, label: Any) -> int:
    for value in (label, prompt):
        try:
            return int(str(value).strip())
        except ValueError:
            continue
    raise ValueError(
        "rollout_client.openrlhf: the label (--data.label_key) or the prompt must be a task index, "
        f"not label={label!r}, prompt={prompt!r}"
    )


def action_ranges(mask: np.ndarray, offset: int) -> list[tuple[int, int]]:
    """(start, end) of each run of 1s in the response's mask, in observation positions."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return [
        (offset + int(start), offset + int(end)) for start, end in zip(edges[::2], edges[1::2], strict=True)
    ]


def response(
    episode: EpisodeArrays,
    reward: float,
    prompt: Any,
    label: Any,
    max_length: int,
    with_logprobs: bool,
    pad_token_id: int,
    counts: StepCounts,
) -> dict[str, Any]:
    """What an OpenRLHF executor returns for one sample: exactly the stored tokens."""
    prompt_ids = episode.prompt_ids
    cap = max_length - len(prompt_ids)
    if cap <= 0:
        raise ValueError(
            f"episode {episode.episode_id}'s prompt has {len(prompt_ids)} tokens, not less than "
            f"max_len={max_length}: raise it (a prompt is never cut)"
        )
    kept = response_for_trainer(episode, cap, pad_token_id, counts)
    masked = episode.status not in TRAINABLE_STATUSES
    return {
        "prompt": prompt,
        "label": label,
        "images": None,
        "mm_train_inputs": None,
        "observation_tokens": prompt_ids.tolist() + kept.ids.tolist(),
        "action_ranges": action_ranges(kept.mask, len(prompt_ids)),
        "rollout_log_probs": [0.0] * len(prompt_ids) + kept.logprobs.tolist() if with_logprobs else None,
        "truncated": episode.status == "truncated" or kept.cut,
        "reward": reward,
        "scores": reward,
        "extra_logs": {
            "rollout_service_masked": float(masked),
            "rollout_service_cut": float(kept.cut),
            "rollout_service_turns": float(episode.num_turns or 0),
        },
        "episode_id": episode.episode_id,
        "episode_status": episode.status,
        "weight_versions": list(episode.weight_versions),
    }


class ServiceExecutor:
    """The executor's behaviour, OpenRLHF aside: AgentExecutor is this on OpenRLHF's
    AgentExecutorBase (its loader takes only that class)."""

    def __init__(self, *, service: ServiceConfig | None = None) -> None:
        self.service = service or ServiceConfig.from_env(adapter="openrlhf")
        self.run_id = self.service.run_id or "openrlhf-" + uuid.uuid4().hex[:12]
        self.counts = StepCounts()
        self._waiter = LoopWaiter(self.service.url, self.service.api_key)
        self._siblings: SiblingCalls[dict[str, Any]] = SiblingCalls()
        self._occurrences: dict[str, int] = {}

    async def execute(
        self,
        prompt: Any,
        label: Any,
        sampling_params: Any,
        max_length: int,
        hf_tokenizer: Any,
        llm_engine: Any,
        images: Any = None,
    ) -> dict[str, Any]:
        if images:
            raise ValueError("rollout_client.openrlhf: the service's environments take no images")
        # One generate_responses call hands its samples the same SamplingParams object (Ray gives each
        # call its own copy): the same prompt dispatched twice at once is two groups.
        key: Hashable = (id(sampling_params), str(prompt), str(label))
        # No await before this: the prompt's sibling calls must find this one still gathering.
        return await self._siblings.row(
            key, lambda size: self.run_group(prompt, label, sampling_params, max_length, hf_tokenizer, size)
        )

    async def run_group(
        self, prompt: Any, label: Any, sampling_params: Any, max_length: int, tokenizer: Any, samples: int
    ) -> list[dict[str, Any]]:
        task = task_of(prompt, label)
        key = digest([prompt, label])
        occurrence = self._occurrences.get(key, 0)
        self._occurrences[key] = occurrence + 1
        async with AsyncRolloutClient(self.service.url, self.service.api_key) as client:
            step = StepBatch(
                batch_id=await client.batch_id(self.run_id, task, key, occurrence, f"n{samples}"),
                env=self.service.env,
                tasks=[task],
                samples=samples,
                task_split=self.service.task_split,
                sampling_params=sglang_sampling_params(sampling_params),
                max_turns=self.service.max_turns,
                metadata={"openrlhf_occurrence": occurrence},
            )
            episodes = await self._waiter().group(client, step, self.counts)
        with_logprobs = getattr(sampling_params, "logprobs", None) is not None
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        return [
            response(episode, reward, prompt, label, max_length, with_logprobs, int(pad), self.counts)
            for episode, reward in zip(episodes, rewards_for_grpo(episodes), strict=True)
        ]


# `from rollout_client.openrlhf import AgentExecutor`: built on first use (it needs the trainer).
__getattr__ = trainer_class(
    "AgentExecutor", ServiceExecutor, "openrlhf.utils.agent:AgentExecutorBase", globals()
)
