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
one service group, each call taking its row; the calls that arrive within ROLLOUT_COALESCE_SECONDS
(default 0.02) of the first are one service batch (rollout_client.siblings: a step's prompts, as
the trainer dispatches them at once), its groups taken as they complete from one GET /groups
long-poll. A cancelled call gives up its row only; when all of a batch's calls are cancelled, the
batch is cancelled in the service. The task is the dataset's label
(`--data.label_key` naming a task-index column), else the prompt text as an integer. Sampling
params are vLLM's (temperature, top_p, top_k, max_tokens). Configured by environment variables, as
rollout_client.slime: ROLLOUT_SERVICE_URL, ROLLOUT_ENV, and optionally ROLLOUT_API_KEY,
ROLLOUT_TASK_SPLIT, ROLLOUT_MAX_TURNS, ROLLOUT_RUN_ID, ROLLOUT_COALESCE_SECONDS. OpenRLHF tells an
executor no step: a batch id is the run's, a hash of its groups' prompts and labels, and its
occurrence in this process, and without ROLLOUT_RUN_ID the run id is new per process (so a restart
never takes an earlier step's episodes).

OpenRLHF takes every result as a sample: a failed, aborted or cancelled episode keeps its row with
no action range (no loss) and, as reward and score, the mean of its group's trained rewards (so it
does not move the group's baseline); `extra_logs` flags it (`rollout_service_masked`). A response
longer than `max_length` minus its prompt is cut with its logprobs (`rollout_service_cut`,
`truncated`). The counts so far are in `executor.counts` (`abandoned`: rows of cancelled calls).

OpenRLHF is imported when AgentExecutor is first used: this module imports without it.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from rollout_client.batch import EpisodeArrays
from rollout_client.siblings import GroupAsk, LoopWaiter, StepCalls
from rollout_client.steps import (
    TRAINABLE_STATUSES,
    ServiceConfig,
    StepBatch,
    StepCounts,
    batch_id,
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
        self._calls: StepCalls[dict[str, Any]] = StepCalls(
            LoopWaiter(self.service.url, self.service.api_key),
            self.step_batch,
            self.counts,
            self.service.coalesce_seconds,
        )
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
        task = task_of(prompt, label)
        with_logprobs = getattr(sampling_params, "logprobs", None) is not None
        pad = hf_tokenizer.pad_token_id
        pad = hf_tokenizer.eos_token_id if pad is None else pad

        def rows(episodes: list[EpisodeArrays], wanted: list[int]) -> list[dict[str, Any]]:
            rewards = rewards_for_grpo(episodes)
            return [
                response(
                    episodes[index], rewards[index], prompt, label, max_length, with_logprobs, int(pad),
                    self.counts,
                )
                for index in wanted
            ]  # fmt: skip

        # One generate_responses call hands its samples the same SamplingParams object (Ray gives each
        # call its own copy): the same prompt dispatched twice at once is two groups.
        ask = GroupAsk(
            call_key=(id(sampling_params), str(prompt), str(label)),
            batch_key=json.dumps(sglang_sampling_params(sampling_params), sort_keys=True, default=str),
            task=task,
            label=[prompt, label],
            convert=rows,
        )
        return await self._calls.row(ask)

    def step_batch(self, key: Hashable, asks: Sequence[GroupAsk[Any]], samples: int) -> StepBatch:
        """The batch of the groups that came together: OpenRLHF tells an executor no step, so its id
        is the run's, the groups' prompts' and their occurrence in this process."""
        parts: list[object] = [[ask.label for ask in asks], samples, key]
        content = digest(parts)
        occurrence = self._occurrences.get(content, 0)
        self._occurrences[content] = occurrence + 1
        return StepBatch(
            batch_id=batch_id(self.run_id, f"n{samples}", content, occurrence),
            env=self.service.env,
            tasks=[ask.task for ask in asks],
            samples=samples,
            task_split=self.service.task_split,
            sampling_params=json.loads(str(key)),
            max_turns=self.service.max_turns,
            metadata={"openrlhf_occurrence": occurrence},
        )


# `from rollout_client.openrlhf import AgentExecutor`: built on first use (it needs the trainer).
__getattr__ = trainer_class(
    "AgentExecutor", ServiceExecutor, "openrlhf.utils.agent:AgentExecutorBase", globals()
)
