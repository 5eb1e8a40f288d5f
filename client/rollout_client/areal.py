"""AReaL's rollout workflow, backed by the rollout service: one workflow path plugs it in.

    trainer.train(workflow="rollout_client.areal.RolloutServiceWorkflow",
                  workflow_kwargs={"gconfig": config.gconfig}, ...)

Follows AReaL at commit 4aef98d8d818af55b43621aaadba047ae10f4e77 (2026-05-21): the trainer's
rollout (RemoteInfEngine.rollout_batch / prepare_batch, areal/infra/remote_inf_engine.py) builds
the workflow from its import path and kwargs, wraps it in GroupedRolloutWorkflow when
`gconfig.n_samples > 1` (`asyncio.gather` of `n_samples` calls of `arun_episode(engine, data)` with
the same data, None rows dropped, the rest concatenated with concat_padded_tensors), and checks
each result with check_trajectory_format. A trajectory is a dict of [1, seqlen] tensors as
areal/workflow/multi_turn.py makes them: `input_ids` (prompt + response), `loss_mask`, `logprobs`
(0 on the prompt), `versions` (the weight version that sampled each token, -1 elsewhere),
`attention_mask`, and `rewards` [1].

The `n_samples` calls of one prompt start in one turn of the event loop with the same data: they
become one service group, and each call takes its row. The calls that arrive within
`coalesce_seconds` (a workflow kwarg, else ROLLOUT_COALESCE_SECONDS, default 0.02) of the first are
one service batch (rollout_client.siblings: rollout_batch starts a step's prompts at once), its
groups taken as they complete from one GET /groups long-poll. A cancelled call gives up its row
only (counted as `abandoned`); when all of a batch's calls are cancelled, the batch is cancelled
in the service. A row's task is `data["task_index"]` (a dataset column), else the last message of
`data["messages"]` as an integer. Sampling comes from `gconfig` (AReaL's GenerationHyperparameters:
temperature, top_p, top_k, max_new_tokens, stop). Configured by environment variables, as
rollout_client.slime: ROLLOUT_SERVICE_URL, ROLLOUT_ENV, and optionally ROLLOUT_API_KEY,
ROLLOUT_TASK_SPLIT, ROLLOUT_MAX_TURNS, ROLLOUT_RUN_ID, ROLLOUT_COALESCE_SECONDS. A batch id is the
run's, the engine's weight version (AReaL sets it each step), the group size, a hash of the groups'
tasks and its occurrence at that version; without ROLLOUT_RUN_ID the run id is new per process
(AReaL tells a workflow no run name), so only a run with ROLLOUT_RUN_ID gets a step's episodes back
on restart.

AReaL can leave a row out: a failed, aborted or cancelled episode is None (rejected), never a
sample with reward 0; a group with none left is rejected whole. A response longer than
`max_response_tokens` (if given) is cut with its mask and logprobs. Both are counted in
`workflow.counts` (StepCounts: `.metrics()`). A weight version that is not an integer (SGLang's
"default", before any update) is -1 in `versions`.

AReaL (and torch) are imported when RolloutServiceWorkflow is first used: this module imports
without them.
"""

from __future__ import annotations

import uuid
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

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
    trainer_class,
)

AREAL_COMMIT = "4aef98d8d818af55b43621aaadba047ae10f4e77"
UNVERSIONED = -1  # AReaL's version of a token no policy sampled (prompt, tool results)
Trajectory = dict[str, npt.NDArray[Any]]


def task_of_data(data: Mapping[str, Any]) -> int:
    if data.get("task_index") is not None:
        return int(data["task_index"])
    messages = data.get("messages")
    content = messages[-1]["content"] if isinstance(messages, Sequence) and messages else messages
    try:
        return int(str(content).strip())
    except ValueError:
        raise ValueError(
            "rollout_client.areal: a data item needs task_index, or messages whose last one is the "
            f"task index, not {content!r}"
        ) from None


def sampling_params(gconfig: Any) -> dict[str, Any]:
    """AReaL's GenerationHyperparameters as SGLang's sampling params."""
    if gconfig is None:
        return {}
    params = {
        "temperature": 0.0 if getattr(gconfig, "greedy", False) else gconfig.temperature,
        "top_p": gconfig.top_p,
        "top_k": gconfig.top_k,
        "max_new_tokens": gconfig.max_new_tokens,
    }
    if getattr(gconfig, "stop", None):
        params["stop"] = list(gconfig.stop)
    return params


def _integer_version(version: str | None) -> int:
    return int(version) if version is not None and version.lstrip("-").isdigit() else UNVERSIONED


def token_versions(episode: EpisodeArrays, kept: int) -> npt.NDArray[np.int32]:
    """Per response token, the integer weight version that sampled it (-1: not sampled, or a
    version that is not an integer). From the Arrow stream, one int() per distinct version of the
    episode and one numpy take for its tokens (a Python object per token cost more than the pull)."""
    versions = np.full(kept, UNVERSIONED, dtype=np.int32)
    column = episode.token_versions
    if isinstance(column, pa.ListScalar):
        if not column.is_valid or kept == 0:
            return versions
        values = column.values.slice(0, kept)
        if not isinstance(values, pa.DictionaryArray):
            values = values.dictionary_encode()
        names = values.dictionary.to_pylist()
        lookup = np.array([*map(_integer_version, names), UNVERSIONED], dtype=np.int32)
        codes = values.indices.fill_null(len(names)).to_numpy(zero_copy_only=False)
        versions[: len(codes)] = lookup[codes]
        return versions
    for position, version in enumerate(episode.token_weight_versions[:kept]):
        versions[position] = _integer_version(version)
    return versions


def trajectory(episode: EpisodeArrays, cap: int | None, counts: StepCounts) -> Trajectory | None:
    """AReaL's trajectory of one episode, [1, seqlen] arrays (None: not trained on, rejected)."""
    if episode.status not in TRAINABLE_STATUSES:
        counts.dropped += 1
        return None
    response = response_for_trainer(episode, cap, 0, counts)
    prompt = len(episode.prompt_ids)
    kept = len(response.ids)
    unsampled = np.zeros(prompt, dtype=np.int32)
    versions = token_versions(episode, kept)
    versions[response.mask == 0] = UNVERSIONED
    row = {
        "input_ids": np.concatenate([episode.prompt_ids, response.ids]).astype(np.int32),
        "loss_mask": np.concatenate([unsampled, response.mask]).astype(np.int32),
        "logprobs": np.concatenate([unsampled, response.logprobs]).astype(np.float32),
        "versions": np.concatenate([unsampled + UNVERSIONED, versions]),
        "attention_mask": np.ones(prompt + kept, dtype=np.bool_),
    }
    arrays = {name: value[None, :] for name, value in row.items()}
    arrays["rewards"] = np.array([episode.reward or 0.0], dtype=np.float32)
    return arrays


def _tensor(array: npt.NDArray[Any]) -> Any:
    import torch  # AReaL's environment has it

    return torch.from_numpy(array)


class ServiceWorkflow:
    """The workflow's behaviour, AReaL aside: RolloutServiceWorkflow is this on AReaL's
    RolloutWorkflow base class (AReaL builds a workflow only of that class)."""

    tensor = staticmethod(_tensor)  # numpy -> the trainer's tensor type

    def __init__(
        self,
        gconfig: Any = None,
        max_response_tokens: int | None = None,
        coalesce_seconds: float | None = None,
        *,
        service: ServiceConfig | None = None,
    ) -> None:
        self.gconfig = gconfig
        self.max_response_tokens = max_response_tokens
        self.service = service or ServiceConfig.from_env(adapter="areal")
        self.run_id = self.service.run_id or "areal-" + uuid.uuid4().hex[:12]
        self.counts = StepCounts()
        window = self.service.coalesce_seconds if coalesce_seconds is None else coalesce_seconds
        self._calls: StepCalls[Trajectory | None] = StepCalls(
            LoopWaiter(self.service.url, self.service.api_key), self.step_batch, self.counts, window
        )
        self._occurrences: dict[tuple[int, str], int] = {}

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> dict[str, Any] | None:
        task = task_of_data(data)
        # GroupedRolloutWorkflow hands a prompt's calls the same data object: they are its group.
        ask = GroupAsk(id(data), int(engine.get_version()), task, task, self.rows)
        row = await self._calls.row(ask)
        if row is None:
            return None
        return {name: self.tensor(array) for name, array in row.items()}

    def rows(self, episodes: list[EpisodeArrays], wanted: list[int]) -> list[Trajectory | None]:
        return [trajectory(episodes[index], self.max_response_tokens, self.counts) for index in wanted]

    def step_batch(self, key: Hashable, asks: Sequence[GroupAsk[Any]], samples: int) -> StepBatch:
        """The batch of the groups that came together at this weight version: its id is the run's,
        the version's, the groups' tasks' and their occurrence at that version (so the same rollout
        at the same version, asked again with the run's id, is the same batch)."""
        version = int(str(key))  # the batch key is the weight version
        tasks = [ask.task for ask in asks]
        content = digest([tasks, samples])
        occurrence = self._occurrences.get((version, content), 0)
        self._occurrences[version, content] = occurrence + 1
        return StepBatch(
            batch_id=batch_id(self.run_id, f"v{version}", f"n{samples}", content, occurrence),
            env=self.service.env,
            tasks=tasks,
            samples=samples,
            task_split=self.service.task_split,
            sampling_params=sampling_params(self.gconfig),
            max_turns=self.service.max_turns,
            max_response_tokens=self.max_response_tokens,
            metadata={"areal_version": version},
        )


# `rollout_client.areal.RolloutServiceWorkflow`: built on first use (it needs the trainer).
__getattr__ = trainer_class(
    "RolloutServiceWorkflow", ServiceWorkflow, "areal.api.workflow_api:RolloutWorkflow", globals()
)
