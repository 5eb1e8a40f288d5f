"""SkyRL's generator, backed by the rollout service: one flag plugs it in.

    python -m skyrl.train.entrypoints.main_base trainer.override_entrypoint=rollout_client.skyrl ...

SkyRL's main_base hands its command line to this module's main(), which runs SkyRL's experiment
with `get_generator` returning RolloutServiceGenerator (experiment_class()). Follows SkyRL at commit
a9564572eb8e91076be43c1bd5e4615e3de17265 (2026-08-21): the trainer (skyrl/train/trainer.py) builds
a GeneratorInput with prepare_generator_input (each dataset row `n_samples_per_prompt` times,
consecutively, with TrajectoryID(instance_id=uid, repetition_id), vLLM-style sampling params and
BatchMetadata(global_step, training_phase)), awaits `generator.generate(input)`, pops
`rollout_metrics` into its logged metrics, and checks the GeneratorOutput with
validate_generator_output: one row per prompt in the input's order; response_ids, loss_masks and
rollout_logprobs of one length per row; rewards a float per row, which it puts on the row's last
response token.

A row's task is `env_extras["task_index"]` (a dataset column), else its prompt's last message
content as an integer. Configured by environment variables, as rollout_client.slime:
ROLLOUT_SERVICE_URL, ROLLOUT_ENV, and optionally ROLLOUT_API_KEY, ROLLOUT_TASK_SPLIT (default
`train`), ROLLOUT_EVAL_TASK_SPLIT (default `test`, SkyRL's eval phase), ROLLOUT_MAX_TURNS,
ROLLOUT_RUN_ID (names the run's batches; by default a hash of the trainer's project and run name).

SkyRL takes one row per prompt: a failed, aborted or cancelled episode keeps its row with
loss_masks all 0 and, as reward, the mean of its group's trained rewards (so it does not move the
group's GRPO baseline); stop_reason is its status. A response longer than
`generator.max_input_length` minus its prompt is cut with its mask and logprobs. Both are counted
in rollout_metrics (`rollout_service/...`). If SkyRL cancels `generate`, the service batch is
cancelled.

SkyRL is imported only by experiment_class() and main(): this module imports without it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from rollout_client.batch import EpisodeArrays
from rollout_client.client import AsyncRolloutClient
from rollout_client.steps import (
    ServiceConfig,
    StepBatch,
    StepCounts,
    digest,
    pull_step_async,
    response_for_trainer,
    rewards_for_grpo,
    sglang_sampling_params,
)

SKYRL_COMMIT = "a9564572eb8e91076be43c1bd5e4615e3de17265"


def _field(config: Any, *path: str) -> Any:
    for name in path:
        if config is None:
            return None
        getter = getattr(config, "get", None)
        config = getter(name, None) if callable(getter) else getattr(config, name, None)
    return config


def task_of_row(prompt: Any, extras: Mapping[str, Any] | None) -> int:
    if extras and extras.get("task_index") is not None:
        return int(extras["task_index"])
    content = (
        prompt[-1]["content"] if isinstance(prompt, Sequence) and not isinstance(prompt, str) else prompt
    )
    try:
        return int(str(content).strip())
    except ValueError:
        raise ValueError(
            "rollout_client.skyrl: a row needs env_extras['task_index'], or a prompt whose last message "
            f"is the task index, not {content!r}"
        ) from None


def _stop_reason(episode: EpisodeArrays) -> str:
    if episode.status == "completed":
        return next((reason for reason in reversed(episode.finish_reasons) if reason), "stop")
    return "length" if episode.status == "truncated" else episode.status


class RolloutServiceGenerator:
    """SkyRL's GeneratorInterface over the service: `await generate(input_batch)`."""

    def __init__(self, cfg: Any, tokenizer: Any, *, service: ServiceConfig | None = None) -> None:
        self.cfg = cfg
        self.service = service or ServiceConfig.from_env(adapter="skyrl")
        self.pad_token_id = int(
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        )
        self.max_input_length = _field(cfg, "generator", "max_input_length")
        self.run_id = self.service.run_id or "skyrl-" + digest([
            _field(cfg, "trainer", "project_name"), _field(cfg, "trainer", "run_name"), self.service.env,
        ])  # fmt: skip
        self._calls: dict[tuple[str, int], int] = {}

    def groups_of(self, input_batch: Mapping[str, Any]) -> list[tuple[int, int, int]]:
        """(first row, rows, task) per group: runs of one instance id (one prompt's samples)."""
        prompts = input_batch["prompts"]
        extras = input_batch.get("env_extras") or [None] * len(prompts)
        ids = input_batch.get("trajectory_ids")
        keys = [tid.instance_id for tid in ids] if ids else list(range(len(prompts)))
        groups: list[tuple[int, int, int]] = []
        for row, key in enumerate(keys):
            if groups and keys[groups[-1][0]] == key:
                groups[-1] = (groups[-1][0], groups[-1][1] + 1, groups[-1][2])
            else:
                groups.append((row, 1, task_of_row(prompts[row], extras[row])))
        return groups

    async def generate(self, input_batch: Mapping[str, Any]) -> dict[str, Any]:
        started = time.monotonic()
        metadata = input_batch.get("batch_metadata")
        phase = getattr(metadata, "training_phase", "train")
        step = int(getattr(metadata, "global_step", -1))
        call = self._calls.get((phase, step), 0)
        self._calls[(phase, step)] = call + 1
        groups = self.groups_of(input_batch)
        counts = StepCounts()
        rows: list[EpisodeArrays | None] = [None] * len(input_batch["prompts"])
        async with AsyncRolloutClient(self.service.url, self.service.api_key) as client:
            for size in sorted({rows_ for _, rows_, _ in groups}):
                chosen = [group for group in groups if group[1] == size]
                tasks = [task for _, _, task in chosen]
                step_batch = StepBatch(
                    batch_id=await client.batch_id(self.run_id, phase, step, call, f"n{size}", digest(tasks)),
                    env=self.service.env,
                    tasks=tasks,
                    samples=size,
                    task_split=self.service.task_split if phase == "train" else self.service.eval_task_split,
                    sampling_params=sglang_sampling_params(input_batch.get("sampling_params")),
                    max_turns=self.service.max_turns,
                    max_response_tokens=self.max_input_length,
                    metadata={"skyrl_step": step, "skyrl_phase": phase},
                )
                for (start, _, _), episodes in zip(
                    chosen, await pull_step_async(client, step_batch, counts), strict=True
                ):
                    rows[start : start + size] = episodes
        output = self.output(rows, [(start, size) for start, size, _ in groups], counts)
        output["trajectory_ids"] = input_batch.get("trajectory_ids")
        output["rollout_metrics"]["rollout_service/seconds"] = time.monotonic() - started
        return output

    def response_cap(self, episode: EpisodeArrays) -> int | None:
        """SkyRL's max_input_length bounds prompt and response: what is left for the response."""
        if self.max_input_length is None:
            return None
        cap = int(self.max_input_length) - len(episode.prompt_ids)
        if cap <= 0:
            raise ValueError(
                f"episode {episode.episode_id}'s prompt has {len(episode.prompt_ids)} tokens, not less than "
                f"generator.max_input_length={self.max_input_length}: raise it (a prompt is never cut)"
            )
        return cap

    def output(
        self, rows: Sequence[EpisodeArrays | None], groups: Sequence[tuple[int, int]], counts: StepCounts
    ) -> dict[str, Any]:
        """The GeneratorOutput of the rows: exactly the stored tokens, one row per prompt."""
        rewards: list[float] = [0.0] * len(rows)
        for start, size in groups:
            group = [row for row in rows[start : start + size] if row is not None]
            rewards[start : start + len(group)] = rewards_for_grpo(group)
        out: dict[str, list[Any]] = {
            name: []
            for name in (
                "prompt_token_ids",
                "response_ids",
                "loss_masks",
                "rollout_logprobs",
                "stop_reasons",
                "env_metrics",
            )
        }
        for episode in rows:
            if episode is None:
                raise RuntimeError("a prompt got no episode")
            response = response_for_trainer(episode, self.response_cap(episode), self.pad_token_id, counts)
            out["prompt_token_ids"].append(episode.prompt_ids.tolist())
            out["response_ids"].append(response.ids.tolist())
            out["loss_masks"].append(response.mask.astype(int).tolist())
            out["rollout_logprobs"].append(response.logprobs.tolist())
            out["stop_reasons"].append(_stop_reason(episode))
            out["env_metrics"].append({
                "episode_id": episode.episode_id,
                "status": episode.status,
                "num_turns": episode.num_turns,
                "weight_versions": list(episode.weight_versions),
                "response_cut": response.cut,
            })  # fmt: skip
        return {
            **out,
            "rewards": rewards,
            "rollout_metrics": counts.metrics(),
            "trajectory_ids": None,
            "trajectory_generation_times": None,
            "trajectory_time_splits": None,
            "rollout_expert_indices": None,
            "is_last_step": None,
            "pixel_values": None,
            "image_grid_thw": None,
        }


def experiment_class() -> type:
    """SkyRL's BasePPOExp with the service's generator: `experiment_class()(cfg).run()`."""
    from skyrl.train.entrypoints.main_base import BasePPOExp

    class RolloutServiceExp(BasePPOExp):  # type: ignore[misc]
        def get_generator(
            self, cfg: Any, tokenizer: Any, inference_engine_client: Any
        ) -> RolloutServiceGenerator:
            return RolloutServiceGenerator(cfg, tokenizer)

    return RolloutServiceExp


OVERRIDE_FLAG = "trainer.override_entrypoint="


def _run_experiment(cfg: Any) -> None:
    experiment_class()(cfg).run()


def main() -> None:
    """SkyRL's main_base.main, with the service's generator: called by main_base itself for
    `trainer.override_entrypoint=rollout_client.skyrl` (that flag is main_base's, not a config field)."""
    import ray
    from skyrl.train.config import SkyRLTrainConfig
    from skyrl.train.utils import validate_cfg
    from skyrl.train.utils.utils import initialize_ray

    cfg = SkyRLTrainConfig.from_cli_overrides(
        [arg for arg in sys.argv[1:] if not arg.startswith(OVERRIDE_FLAG)]
    )
    validate_cfg(cfg)
    initialize_ray(cfg)
    # As main_base's skyrl_entrypoint: the training loop runs in a Ray task, not on the head node.
    ray.get(ray.remote(num_cpus=1)(_run_experiment).remote(cfg))
