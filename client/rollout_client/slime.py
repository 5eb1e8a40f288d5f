"""slime's rollout hooks, backed by the rollout service: one flag replaces slime's tau-bench example.

    --custom-generate-function-path rollout_client.slime.generate      # one episode per Sample
    --rollout-function-path rollout_client.slime.generate_rollout      # one service batch per step

Configured by environment variables: ROLLOUT_SERVICE_URL, ROLLOUT_ENV (e.g. `tau-bench/retail`),
and optionally ROLLOUT_API_KEY, ROLLOUT_TASK_SPLIT (default `train`), ROLLOUT_EVAL_TASK_SPLIT
(default `test`), ROLLOUT_MAX_TURNS, ROLLOUT_RUN_ID (names the run's batches; by default derived
from slime's arguments). A prompt is a task index: `int(sample.prompt)` (slime's `--input-key
index`), or `sample.metadata["task_index"]`.

slime is imported lazily, inside the hooks: this module imports without it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from rollout_client import AsyncRolloutClient, EpisodeArrays, RolloutClient
from rollout_client.steps import ServiceConfig, cancel_once_submitted

logger = logging.getLogger(__name__)

GROUPS_WAIT_SECONDS = 10.0  # generate_rollout: one long-poll of GET /groups for the step's next groups
GROUPS_PER_PAGE = 256  # generate_rollout: groups per page of GET /groups, at most
MAX_PENDING_BATCHES = 256  # GET /groups' batch_id filter takes this many
EPISODE_WAIT_SECONDS = 30.0  # generate: one long-poll of the episode
# Service status -> slime's Sample.Status name. A cancelled episode is an abort, as slime's own
# abort at the end of a step leaves its samples.
# Sampling param -> the field of slime's EvalDatasetConfig that sets it for an eval dataset.
EVAL_SAMPLING_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "max_new_tokens": "max_response_len",
}
STATUS_NAMES = {
    "completed": "COMPLETED",
    "truncated": "TRUNCATED",
    "aborted": "ABORTED",
    "failed": "FAILED",
    "cancelled": "ABORTED",
}


HookConfig = ServiceConfig  # the environment settings every adapter reads (rollout_client.steps)


# ---- what slime's arguments mean to the service ----


def sampling_params_of(args: Any) -> dict[str, Any]:
    """The sampling params slime's own rollout sends (slime.rollout.sglang_rollout.GenerateState);
    `max_new_tokens` is per turn, as in slime's tau-bench example."""
    params: dict[str, Any] = {
        "temperature": args.rollout_temperature,
        "top_p": args.rollout_top_p,
        "top_k": args.rollout_top_k,
        "max_new_tokens": args.rollout_max_response_len,
        "stop": args.rollout_stop,
        "stop_token_ids": args.rollout_stop_token_ids,
        "skip_special_tokens": args.rollout_skip_special_tokens,
        "no_stop_trim": True,
        "spaces_between_special_tokens": False,
    }
    return params


def task_index_of(sample: Any) -> int:
    metadata = sample.metadata or {}
    if "task_index" in metadata:
        return int(metadata["task_index"])
    return int(sample.prompt)


def run_id_of(args: Any, config: HookConfig) -> str:
    """The run's name in batch ids: ROLLOUT_RUN_ID, else a hash of what identifies a slime run, so
    that a restarted trainer asks for the same batches and gets their episodes back."""
    if config.run_id:
        return config.run_id
    identity = [
        getattr(args, name, None) for name in ("save", "load", "hf_checkpoint", "prompt_data", "rollout_seed")
    ]
    identity += [config.env, config.task_split]
    digest = hashlib.sha256(json.dumps(identity, default=str).encode()).hexdigest()[:12]
    return f"slime-{digest}"


@cache
def _tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer  # slime's environment has it; this package does not need it

    return AutoTokenizer.from_pretrained(path, trust_remote_code=True)


def _decode(args: Any, ids: Iterable[int]) -> str:
    path = getattr(args, "hf_checkpoint", None)
    if not path:
        return ""
    return str(_tokenizer(str(path)).decode(list(ids), skip_special_tokens=False))


def fill_sample(args: Any, sample: Any, episode: EpisodeArrays) -> Any:
    """`sample` filled from a finished episode as slime's own generate fills it: tokens = prompt +
    response, loss mask and logprobs over the response, reward, status, one weight version per
    generate call. An episode without a response (it failed or was cancelled before sampling) gets
    slime's placeholder for a sample it must not train on: one masked token, remove_sample=True."""
    response = episode.response_ids
    if len(response):
        sample.tokens = episode.prompt_ids.tolist() + response.tolist()
        sample.response_length = len(response)
        sample.loss_mask = episode.loss_mask.astype(int).tolist()
        sample.rollout_log_probs = episode.rollout_logprobs.tolist()
        sample.response = _decode(args, response)
    else:
        sample.tokens = [*episode.prompt_ids.tolist(), 0] if len(episode.prompt_ids) else [0, 0]
        sample.response_length = 1
        sample.loss_mask = [0]
        sample.rollout_log_probs = [0.0]
        sample.response = ""
        sample.remove_sample = True
    sample.status = getattr(type(sample).Status, STATUS_NAMES[episode.status])
    if not episode.trainable:  # failed, aborted or cancelled: the service's `trainable`, as every adapter
        sample.remove_sample = True
    sample.reward = 0.0 if episode.reward is None else float(episode.reward)
    sample.weight_versions = ["" if version is None else str(version) for version in episode.weight_versions]
    sample.metadata = {
        **(sample.metadata or {}),
        "episode_id": episode.episode_id,
        "batch_id": episode.batch_id,
        "task_index": episode.task_index,
        "attempt": episode.attempt,
        "num_turns": episode.num_turns,
        "error": episode.error,
        "info": episode.info,
    }
    return sample


# ---- --custom-generate-function-path ----


@cache
def _async_client(loop: asyncio.AbstractEventLoop, url: str, api_key: str | None) -> AsyncRolloutClient:
    """One client (one connection pool) per event loop: slime runs its rollouts on one loop thread."""
    return AsyncRolloutClient(url, api_key)


async def generate(args: Any, sample: Any, sampling_params: dict[str, Any]) -> Any:
    """Runs the sample's task as one episode of the service and returns the sample filled. If slime
    cancels this coroutine, the episode is cancelled in the service too."""
    config = ServiceConfig.from_env(adapter="slime")
    client = _async_client(asyncio.get_running_loop(), config.url, config.api_key)
    batch_id = await client.batch_id(run_id_of(args, config), "sample", sample.index, uuid.uuid4().hex[:12])
    submitting = asyncio.ensure_future(
        client.submit(
            config.env,
            [task_index_of(sample)],
            task_split=config.task_split,
            sampling_params=sampling_params,
            max_turns=config.max_turns,
            batch_id=batch_id,
            metadata={"slime_index": sample.index, "slime_group_index": sample.group_index},
        )
    )
    try:
        await asyncio.shield(submitting)
        await client.wait(batch_id, poll=EPISODE_WAIT_SECONDS)
        episode = (await client.batch(batch_id, include_cancelled=True))[0]
    except asyncio.CancelledError:
        await asyncio.shield(cancel_once_submitted(client, submitting, batch_id))
        raise
    return fill_sample(args, sample, episode)


# ---- --rollout-function-path ----


def generate_rollout(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False) -> Any:
    """slime's rollout function: a step's groups from the service (train), or the eval datasets'
    rewards (evaluation=True)."""
    config = ServiceConfig.from_env(adapter="slime")
    with RolloutClient(config.url, config.api_key) as client:
        if evaluation:
            return _evaluate(args, rollout_id, client, config)
        return _train(args, rollout_id, data_source, client, config)


@dataclass
class _Submitted:
    batch_id: str
    groups: dict[int, list[Any]]  # group index in the batch -> its slime samples, until it finished


def _train(args: Any, rollout_id: int, data_source: Any, client: RolloutClient, config: HookConfig) -> Any:
    """slime's generate_rollout_async, with the service running the groups: over-sample by
    `over_sampling_batch_size` groups at a time, filter each group as it completes, draw more until
    `rollout_batch_size` groups passed, then cancel the surplus."""
    from slime.rollout.base_types import RolloutFnTrainOutput
    from slime.rollout.filter_hub.base_types import (
        MetricGatherer,
        call_dynamic_filter,
        should_drop_dynamic_filter_output,
    )
    from slime.utils.misc import load_function

    target = args.rollout_batch_size
    dynamic_filter = (
        load_function(args.dynamic_sampling_filter_path) if args.dynamic_sampling_filter_path else None
    )
    metrics = MetricGatherer()
    run_id = run_id_of(args, config)
    submitted: list[_Submitted] = []
    remaining = 0  # groups submitted and not dropped (slime's remaining_batch_size)
    data: list[list[Any]] = []
    cursor = 0  # GET /groups' cursor over this step's batches
    started = time.monotonic()
    while len(data) < target:
        while remaining < target:
            groups = data_source.get_samples(args.over_sampling_batch_size)
            batch_id = client.batch_id(run_id, "rollout", rollout_id, len(submitted))
            client.submit(
                config.env,
                [task_index_of(group[0]) for group in groups],
                samples_per_task=args.n_samples_per_prompt,
                task_split=config.task_split,
                sampling_params=sampling_params_of(args),
                max_turns=config.max_turns,
                batch_id=batch_id,
                metadata={"slime_rollout_id": rollout_id},
            )
            submitted.append(_Submitted(batch_id, dict(enumerate(groups))))
            remaining += len(groups)
        finished, cursor = _finished_groups(args, client, submitted, cursor)
        for group in finished:
            verdict = call_dynamic_filter(dynamic_filter, args, group)
            if should_drop_dynamic_filter_output(
                verdict, remaining_batch_size=remaining, target_data_size=target
            ):
                metrics.on_dynamic_filter_drop(reason=verdict.reason)
                remaining -= 1
            elif len(data) < target:
                data.append(group)
    for batch in submitted:
        if batch.groups:  # the surplus: no work left behind in the service
            client.cancel(batch.batch_id)
    data.sort(key=lambda group: group[0].index)
    logger.info(
        "rollout %d: %d groups from %d batches in %.1f s", rollout_id, len(data), len(submitted),
        time.monotonic() - started,
    )  # fmt: skip
    return RolloutFnTrainOutput(samples=data, metrics=metrics.collect())


def _finished_groups(
    args: Any, client: RolloutClient, submitted: list[_Submitted], after: int
) -> tuple[list[list[Any]], int]:
    """The groups of the step's unfinished batches that completed past the cursor `after`, filled,
    and the next cursor: one long-poll of GET /groups, which answers as soon as a group completes,
    with the episodes as Arrow. Every batch with a group still to come stays in the filter: the
    cursor moves past what the filter matched, so a batch left out would lose its groups."""
    pending = {batch.batch_id: batch for batch in submitted if batch.groups}
    if len(pending) > MAX_PENDING_BATCHES:
        raise RuntimeError(
            f"{len(pending)} batches of this rollout are unfinished, more than GET /groups takes at "
            f"once ({MAX_PENDING_BATCHES}): raise --over-sampling-batch-size"
        )
    # Every group of the step, cancelled ones too: each fills its samples (removed, not trained on).
    page = client.groups(
        after, GROUPS_PER_PAGE, GROUPS_WAIT_SECONDS, include_cancelled=True, batch_id=list(pending)
    )
    finished = [
        _fill_group(args, pending[batch_id].groups.pop(group_index), episodes)
        for (batch_id, group_index), episodes in page.groups().items()
    ]
    return finished, page.next


def _fill_group(args: Any, samples: list[Any], episodes: list[EpisodeArrays]) -> list[Any]:
    if len(samples) != len(episodes):
        raise RuntimeError(f"a group of {len(samples)} samples came back with {len(episodes)} episodes")
    return [fill_sample(args, sample, episode) for sample, episode in zip(samples, episodes, strict=True)]


def _evaluate(args: Any, rollout_id: int, client: RolloutClient, config: HookConfig) -> Any:
    """Each eval dataset (`--eval-prompt-data name path`, a JSONL of task indices) as one batch of
    the eval split, with the dataset's sampling settings; slime's eval output."""
    from slime.rollout.base_types import RolloutFnEvalOutput
    from slime.utils.types import Sample

    run_id = run_id_of(args, config)
    data: dict[str, dict[str, Any]] = {}
    for dataset in getattr(args, "eval_datasets", None) or []:
        tasks = _task_indices(Path(dataset.path), dataset.input_key or "index")
        samples_per_task = dataset.n_samples_per_eval_prompt
        batch_id = client.batch_id(run_id, "eval", rollout_id, dataset.name)
        client.submit(
            config.env,
            tasks,
            samples_per_task=samples_per_task,
            task_split=config.eval_task_split,
            sampling_params=_eval_sampling_params(args, dataset),
            max_turns=config.max_turns,
            batch_id=batch_id,
            metadata={"slime_rollout_id": rollout_id, "slime_eval": dataset.name},
        )
        client.wait(batch_id)
        episodes = list(client.batch(batch_id, include_cancelled=True))
        samples = [
            fill_sample(args, Sample(index=index, prompt=str(episode.task_index)), episode)
            for index, episode in enumerate(episodes)
        ]
        data[dataset.name] = {
            "rewards": [sample.reward for sample in samples],
            "truncated": [sample.status == Sample.Status.TRUNCATED for sample in samples],
            "samples": samples,
        }
    return RolloutFnEvalOutput(data=data)


def _eval_sampling_params(args: Any, dataset: Any) -> dict[str, Any]:
    """The rollout's sampling params with the dataset's own (slime's --eval-* flags) over them."""
    params = sampling_params_of(args)
    for name, field in EVAL_SAMPLING_FIELDS.items():
        value = getattr(dataset, field, None)
        if value is not None:
            params[name] = value
    return params


def _task_indices(path: Path, key: str) -> list[int]:
    with path.open() as lines:
        return [int(json.loads(line)[key]) for line in lines if line.strip()]
