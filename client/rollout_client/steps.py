"""What every trainer adapter does with one step: submit its groups as one service batch under an id
derived from the step, take the complete groups from GET /groups (Arrow) as they finish, and cancel
the batch if the trainer's step is cancelled. No trainer is imported here.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from rollout_client.batch import EpisodeArrays
from rollout_client.client import AsyncRolloutClient, RolloutClient
from rollout_client.errors import RequestError, RolloutError
from rollout_client.plans import batch_id as batch_id

DEFAULT_TASK_SPLIT = "train"
DEFAULT_EVAL_TASK_SPLIT = "test"  # a trainer's validation or eval mode
GROUPS_WAIT_SECONDS = 10.0  # one long-poll of GET /groups for the step's next groups
GROUPS_PER_PAGE = 256  # groups per page of GET /groups, at most
DEFAULT_COALESCE_SECONDS = 0.02  # AReaL's, OpenRLHF's calls this close to the first share a batch
# Trained on: the policy's own episodes. An aborted episode (the engine refused it, or the policy's
# output could not be parsed) and a failed or cancelled one (infrastructure, or nobody's) are not.
TRAINABLE_STATUSES = frozenset({"completed", "truncated"})
# vLLM's sampling params (SkyRL's, OpenRLHF's) -> SGLang's (the service passes them to SGLang per turn).
VLLM_SAMPLING_NAMES = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "max_tokens": "max_new_tokens",
    "stop": "stop",
    "skip_special_tokens": "skip_special_tokens",
}


@dataclass(frozen=True)
class ServiceConfig:
    """Where the service is and what to run, from ROLLOUT_* environment variables (the trainers
    start the adapters in their own processes: the environment is what reaches them)."""

    url: str
    env: str
    api_key: str | None = None
    task_split: str = DEFAULT_TASK_SPLIT
    eval_task_split: str = DEFAULT_EVAL_TASK_SPLIT
    max_turns: int | None = None
    run_id: str | None = None
    # AReaL, OpenRLHF: the calls arriving within this many seconds of the first share a batch.
    coalesce_seconds: float = DEFAULT_COALESCE_SECONDS

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ, *, adapter: str) -> ServiceConfig:
        missing = [name for name in ("ROLLOUT_SERVICE_URL", "ROLLOUT_ENV") if not environ.get(name)]
        if missing:
            raise RuntimeError(
                f"rollout_client.{adapter} needs the environment variables {', '.join(missing)}"
            )
        max_turns = environ.get("ROLLOUT_MAX_TURNS")
        coalesce = environ.get("ROLLOUT_COALESCE_SECONDS")
        return cls(
            url=environ["ROLLOUT_SERVICE_URL"],
            env=environ["ROLLOUT_ENV"],
            api_key=environ.get("ROLLOUT_API_KEY") or None,
            task_split=environ.get("ROLLOUT_TASK_SPLIT") or DEFAULT_TASK_SPLIT,
            eval_task_split=environ.get("ROLLOUT_EVAL_TASK_SPLIT") or DEFAULT_EVAL_TASK_SPLIT,
            max_turns=int(max_turns) if max_turns else None,
            run_id=environ.get("ROLLOUT_RUN_ID") or None,
            coalesce_seconds=_seconds("ROLLOUT_COALESCE_SECONDS", coalesce)
            if coalesce
            else DEFAULT_COALESCE_SECONDS,
        )


def _seconds(name: str, value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0 or seconds == float("inf"):
        raise ValueError(f"{name} must be seconds >= 0, not {value!r}")
    return seconds


def trainer_class(name: str, behaviour: type, base: str, namespace: dict[str, Any]) -> Callable[[str], Any]:
    """A module's __getattr__ that names `behaviour` as a subclass of the trainer's class `base`
    ("module:Class"), for a trainer that takes only its own class's subclasses: built when first
    asked for, so that the adapter's module imports without the trainer."""

    def attribute(asked: str) -> Any:
        if asked != name:
            raise AttributeError(f"module {namespace['__name__']!r} has no attribute {asked!r}")
        module, _, attribute_name = base.partition(":")
        trainer_base = getattr(importlib.import_module(module), attribute_name)
        namespace[name] = type(name, (behaviour, trainer_base), {"__module__": behaviour.__module__})
        return namespace[name]

    return attribute


def sglang_sampling_params(params: Any) -> dict[str, Any]:
    """vLLM's sampling params (a mapping, or a SamplingParams) as SGLang's; unset ones left out."""
    if params is None:
        return {}
    if isinstance(params, Mapping):
        values = dict(params)
    else:
        values = {name: getattr(params, name, None) for name in VLLM_SAMPLING_NAMES}
    return {
        VLLM_SAMPLING_NAMES[k]: v for k, v in values.items() if k in VLLM_SAMPLING_NAMES and v is not None
    }


def digest(value: object) -> str:
    """A short stable hash of a JSON-able value: what tells two steps' contents apart in a batch id."""
    return hashlib.sha256(json.dumps(value, default=str, sort_keys=True).encode()).hexdigest()[:10]


@dataclass(frozen=True)
class StepBatch:
    """One trainer step as one service batch: `tasks[g]` is group g's task, `samples` per group."""

    batch_id: str
    env: str
    tasks: Sequence[int]
    samples: int
    task_split: str | None = None
    sampling_params: Mapping[str, Any] | None = None
    max_turns: int | None = None
    max_response_tokens: int | None = None
    metadata: Mapping[str, Any] | None = None

    def submit_fields(self) -> dict[str, Any]:
        return {
            "samples_per_task": self.samples,
            "task_split": self.task_split,
            "sampling_params": dict(self.sampling_params) if self.sampling_params is not None else None,
            "max_turns": self.max_turns,
            "max_response_tokens": self.max_response_tokens,
            "metadata": dict(self.metadata) if self.metadata is not None else None,
            "batch_id": self.batch_id,
        }


@dataclass
class StepCounts:
    """What a step's episodes were, by status, and what the adapter did to fit the trainer."""

    statuses: dict[str, int] = field(default_factory=dict)
    masked: int = 0  # episodes kept in the batch with a zero mask (the trainer needs every row)
    dropped: int = 0  # episodes left out (the trainer takes fewer rows)
    cut: int = 0  # responses cut at the trainer's length cap (mask and logprobs cut alike)
    abandoned: int = 0  # rows whose call was cancelled before its group came (nobody took them)
    groups_pages: int = 0  # GET /groups calls the step made

    def count(self, episodes: Iterable[EpisodeArrays]) -> None:
        for episode in episodes:
            self.statuses[episode.status] = self.statuses.get(episode.status, 0) + 1

    def metrics(self, prefix: str = "rollout_service/") -> dict[str, float]:
        values: dict[str, float] = {
            f"{prefix}{status}": float(n) for status, n in sorted(self.statuses.items())
        }
        values.update({
            f"{prefix}masked": float(self.masked),
            f"{prefix}dropped": float(self.dropped),
            f"{prefix}cut": float(self.cut),
            f"{prefix}abandoned": float(self.abandoned),
            f"{prefix}groups_requests": float(self.groups_pages),
        })  # fmt: skip
        return values


def rewards_for_grpo(episodes: Sequence[EpisodeArrays]) -> list[float]:
    """A group's rewards for a trainer that keeps every row: an episode not trained on gets the mean
    of the group's trained rewards (0.0 if none), so it does not move the group's baseline."""
    trained = [float(e.reward or 0.0) for e in episodes if e.status in TRAINABLE_STATUSES]
    fill = sum(trained) / len(trained) if trained else 0.0
    return [float(e.reward or 0.0) if e.status in TRAINABLE_STATUSES else fill for e in episodes]


@dataclass(frozen=True)
class TrainerResponse:
    """An episode's response as a trainer takes it: exactly the stored tokens, up to the cap."""

    ids: npt.NDArray[np.int32]
    mask: npt.NDArray[np.uint8]  # all 0 for an episode not trained on
    logprobs: npt.NDArray[np.float64]
    cut: bool  # longer than the cap: ids, mask and logprobs cut alike


def response_for_trainer(
    episode: EpisodeArrays, cap: int | None, pad_token_id: int, counts: StepCounts
) -> TrainerResponse:
    """The episode's response cut at `cap` (counted), its mask zeroed if it is not trained on
    (counted as masked); an episode that sampled nothing gets one masked pad token, since the
    trainers read a completion's last token (its reward goes there)."""
    length = len(episode.response_ids)
    cut = cap is not None and length > cap
    kept = min(length, cap) if cap is not None else length
    counts.cut += cut
    trained = episode.status in TRAINABLE_STATUSES
    counts.masked += not trained
    if kept == 0:
        return TrainerResponse(
            np.array([pad_token_id], np.int32), np.zeros(1, np.uint8), np.zeros(1, np.float64), cut
        )
    mask = episode.loss_mask[:kept] if trained else np.zeros(kept, np.uint8)
    return TrainerResponse(episode.response_ids[:kept], mask, episode.rollout_logprobs[:kept], cut)


def _check_group(step: StepBatch, group: int, episodes: list[EpisodeArrays]) -> None:
    if len(episodes) != step.samples:
        raise RuntimeError(
            f"group {group} of batch {step.batch_id} came back with {len(episodes)} episodes, "
            f"not {step.samples}"
        )


def pull_step(
    client: RolloutClient,
    step: StepBatch,
    counts: StepCounts,
    on_groups: Callable[[dict[int, list[EpisodeArrays]]], None] | None = None,
) -> list[list[EpisodeArrays]]:
    """Submits the step (idempotent: a repeated id gets the same episodes back) and returns every
    group, in the step's group order, each in sample order; `on_groups` is given each page's groups
    (group index -> episodes) as they come, to convert them while the next ones run. If the wait is
    interrupted (the trainer stops the step: KeyboardInterrupt, an error in another thread's
    callback), the batch is cancelled."""
    client.submit(step.env, step.tasks, **step.submit_fields())
    groups: dict[int, list[EpisodeArrays]] = {}
    cursor = 0
    try:
        while len(groups) < len(step.tasks):
            page = client.groups(
                cursor, GROUPS_PER_PAGE, GROUPS_WAIT_SECONDS, include_cancelled=True, batch_id=step.batch_id
            )
            counts.groups_pages += 1
            arrived: dict[int, list[EpisodeArrays]] = {}
            for (_, group), episodes in page.groups().items():
                _check_group(step, group, episodes)
                arrived[group] = episodes
            groups |= arrived
            if on_groups is not None and arrived:
                on_groups(arrived)
            cursor = page.next
    except BaseException:
        _cancel_quietly(client, step.batch_id)
        raise
    ordered = [groups[group] for group in range(len(step.tasks))]
    for episodes in ordered:
        counts.count(episodes)
    return ordered


def _cancel_quietly(client: RolloutClient, batch_id: str) -> None:
    try:
        client.cancel(batch_id)
    except RolloutError:  # the step's own error is the one to raise
        pass


async def pull_step_async(
    client: AsyncRolloutClient, step: StepBatch, counts: StepCounts
) -> list[list[EpisodeArrays]]:
    """pull_step for an asyncio trainer: if the task is cancelled (even while its POST is in flight),
    the batch is cancelled in the service once the POST has ended, and the cancellation goes on."""
    submitting = asyncio.ensure_future(client.submit(step.env, step.tasks, **step.submit_fields()))
    groups: dict[int, list[EpisodeArrays]] = {}
    cursor = 0
    try:
        await asyncio.shield(submitting)
        while len(groups) < len(step.tasks):
            page = await client.groups(
                cursor, GROUPS_PER_PAGE, GROUPS_WAIT_SECONDS, include_cancelled=True, batch_id=step.batch_id
            )
            counts.groups_pages += 1
            for (_, group), episodes in page.groups().items():
                _check_group(step, group, episodes)
                groups[group] = episodes
            cursor = page.next
    except asyncio.CancelledError:
        await asyncio.shield(cancel_once_submitted(client, submitting, step.batch_id))
        raise
    ordered = [groups[group] for group in range(len(step.tasks))]
    for episodes in ordered:
        counts.count(episodes)
    return ordered


async def cancel_once_submitted(
    client: AsyncRolloutClient, submitting: asyncio.Future[Any], batch_id: str
) -> None:
    """A cancel sent before the POST landed would find no batch while its episodes run on."""
    try:
        await submitting
    except RolloutError:  # refused, or no answer: whether the batch exists, the cancel finds out
        pass
    try:
        await client.cancel(batch_id)
    except RequestError as error:
        if error.status_code != 404:  # the service never took the batch: nothing to stop
            raise
