"""TRL's GRPOTrainer rollout function, backed by the rollout service: one line plugs it in.

    from rollout_client import trl as service
    GRPOTrainer(..., rollout_func=service.rollout_func, reward_funcs=service.service_reward)

Follows TRL at commit f2cd57710ae345ea6428ae95363267fcf38a3dc8 (2026-07-24): GRPOTrainer._generate
calls `rollout_func(prompts, trainer)` with the process's prompts (each repeated `num_generations`
times, consecutively, by its RepeatSampler; `num_generations_eval` in eval mode) and takes one
completion per prompt: `prompt_ids`, `completion_ids`, `logprobs` (lists of lists), the optional
`env_mask` (1 on the model's tokens, 0 on tool results and user turns), and every other key as a
column the reward functions receive. A reward function's None is an unscorable completion: TRL
leaves it out of its group's baseline and gives it no advantage.

A prompt is a task index: the dataset's `prompt` column holds it as text (`"12"`), or as the
content of the last message of a conversational prompt. Configured by environment variables, as
rollout_client.slime: ROLLOUT_SERVICE_URL, ROLLOUT_ENV, and optionally ROLLOUT_API_KEY,
ROLLOUT_TASK_SPLIT (default `train`), ROLLOUT_EVAL_TASK_SPLIT (default `test`, TRL's eval mode),
ROLLOUT_MAX_TURNS, ROLLOUT_RUN_ID (names the run's batches; by default a hash of the output dir).

A failed, aborted or cancelled episode keeps its row (TRL takes one per prompt) with `env_mask`
all 0 and `service_reward` None. A response longer than `max_completion_length` (the service caps
the sampled tokens there; a tool result after the last turn can overrun) is cut with its mask and
logprobs, and counted. The counts go to the trainer's logged metrics (`rollout_service/...`).

TRL is not imported: this module needs nothing of it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from rollout_client.batch import EpisodeArrays
from rollout_client.client import RolloutClient
from rollout_client.steps import (
    TRAINABLE_STATUSES,
    ServiceConfig,
    StepBatch,
    StepCounts,
    digest,
    pull_step,
    response_for_trainer,
)

TRL_COMMIT = "f2cd57710ae345ea6428ae95363267fcf38a3dc8"


def task_of_prompt(prompt: Any) -> int:
    """The task index a TRL prompt names: the text itself, or the last message's content."""
    if isinstance(prompt, Sequence) and not isinstance(prompt, str) and prompt:
        last = prompt[-1]
        prompt = last["content"] if isinstance(last, Mapping) else last
    try:
        return int(str(prompt).strip())
    except ValueError:
        raise ValueError(
            f"rollout_client.trl: a prompt must be a task index (the dataset's prompt column), not {prompt!r}"
        ) from None


def group_rows(prompts: Sequence[Any], generations: int) -> list[tuple[int, int, int]]:
    """(first row, rows, task) per group: runs of the same prompt, at most `generations` rows each
    (TRL's sampler repeats each prompt `generations` times; a process's slice may cut a group)."""
    groups: list[tuple[int, int, int]] = []
    for row, prompt in enumerate(prompts):
        task = task_of_prompt(prompt)
        if groups and groups[-1][2] == task and groups[-1][1] < generations:
            start, size, _ = groups[-1]
            groups[-1] = (start, size + 1, task)
        else:
            groups.append((row, 1, task))
    return groups


def sampling_params(trainer: Any, max_new_tokens: int | None) -> dict[str, Any]:
    """TRL's sampling settings as SGLang's (top_k 0, TRL's "off", is SGLang's -1)."""
    params: dict[str, Any] = {
        "temperature": trainer.temperature,
        "top_p": trainer.top_p,
        "top_k": trainer.top_k if trainer.top_k else -1,
        "repetition_penalty": trainer.repetition_penalty,
    }
    if getattr(trainer, "min_p", None) is not None:
        params["min_p"] = trainer.min_p
    if max_new_tokens is not None:
        params["max_new_tokens"] = max_new_tokens
    return params


class ServiceRollout:
    """The rollout function; `rollout_func` below is one with the settings from the environment.
    Each call is one service batch per group size, its id from the run, the mode, TRL's global
    step and process, and the call's number within that step (so a restarted trainer asking for
    the same step gets the same episodes back)."""

    def __init__(self, service: ServiceConfig | None = None) -> None:
        self._service = service
        self._calls: dict[tuple[str, int, int], int] = {}

    @property
    def service(self) -> ServiceConfig:
        if self._service is None:
            self._service = ServiceConfig.from_env(adapter="trl")
        return self._service

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
        started = time.monotonic()
        service = self.service
        training = bool(trainer.model.training)
        mode = "train" if training else "eval"
        generations = trainer.num_generations if training else trainer.num_generations_eval
        step = int(trainer.state.global_step)
        process = int(getattr(getattr(trainer, "accelerator", None), "process_index", 0))
        call = self._calls.get((mode, step, process), 0)
        self._calls[(mode, step, process)] = call + 1
        run_id = service.run_id or "trl-" + digest([getattr(trainer.args, "output_dir", None), service.env])
        cap = getattr(trainer, "max_completion_length", None)
        groups = group_rows(prompts, generations)
        counts = StepCounts()
        rows: list[EpisodeArrays | None] = [None] * len(prompts)
        with RolloutClient(service.url, service.api_key) as client:
            for size in sorted({rows_ for _, rows_, _ in groups}):
                chosen = [group for group in groups if group[1] == size]
                tasks = [task for _, _, task in chosen]
                step_batch = StepBatch(
                    batch_id=client.batch_id(
                        run_id, mode, step, f"p{process}", call, f"n{size}", digest(tasks)
                    ),
                    env=service.env,
                    tasks=tasks,
                    samples=size,
                    task_split=service.task_split if training else service.eval_task_split,
                    sampling_params=sampling_params(trainer, cap),
                    max_turns=service.max_turns,
                    max_response_tokens=cap,
                    metadata={"trl_step": step, "trl_mode": mode, "trl_process": process},
                )
                for (start, _, _), episodes in zip(
                    chosen, pull_step(client, step_batch, counts), strict=True
                ):
                    rows[start : start + size] = episodes
        output = completions(rows, cap, _pad_token_id(trainer), counts)
        metrics = counts.metrics()
        metrics["rollout_service/seconds"] = time.monotonic() - started
        logged = getattr(trainer, "_metrics", None)  # GRPOTrainer's per-mode lists of logged values
        if isinstance(logged, Mapping) and mode in logged:
            for name, value in metrics.items():
                logged[mode][name].append(value)
        output["rollout_service"] = metrics  # not a list: TRL hands it to every reward call as is
        return output


def _pad_token_id(trainer: Any) -> int:
    tokenizer = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)  # a processor's
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return int(pad)


def completions(
    rows: Sequence[EpisodeArrays | None], cap: int | None, pad_token_id: int, counts: StepCounts
) -> dict[str, Any]:
    """TRL's rollout_func output: one completion per row, exactly the stored tokens. An episode
    that sampled nothing gets one masked pad token: TRL reads every completion's last token."""
    out: dict[str, list[Any]] = {
        name: []
        for name in (
            "prompt_ids", "completion_ids", "logprobs", "env_mask", "service_reward", "episode_id",
            "episode_status", "weight_versions", "response_cut",
        )
    }  # fmt: skip
    for episode in rows:
        if episode is None:
            raise RuntimeError("a prompt got no episode")
        response = response_for_trainer(episode, cap, pad_token_id, counts)
        trained = episode.status in TRAINABLE_STATUSES
        out["prompt_ids"].append(episode.prompt_ids.tolist())
        out["completion_ids"].append(response.ids.tolist())
        out["logprobs"].append(response.logprobs.tolist())
        out["env_mask"].append(response.mask.astype(int).tolist())
        out["service_reward"].append(float(episode.reward or 0.0) if trained else None)
        out["episode_id"].append(episode.episode_id)
        out["episode_status"].append(episode.status)
        out["weight_versions"].append(list(episode.weight_versions))
        out["response_cut"].append(response.cut)
    return dict(out)


def service_reward(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float | None]:
    """TRL reward function: the service's reward of each completion's episode (None: not the
    policy's data, an unscorable completion to TRL)."""
    rewards: list[float | None] = kwargs["service_reward"]
    return rewards


rollout_func = ServiceRollout()
