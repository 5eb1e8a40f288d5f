"""verl's agent-loop manager, backed by the rollout service: one config line plugs it in.

    actor_rollout_ref.rollout.agent.agent_loop_manager_class=rollout_client.verl.RolloutServiceAgentLoopManager

Follows verl at commit b178a3cd56f58b2d502255daba591e92833930a7 (2026-01-29): RayPPOTrainer loads
the class named by `agent_loop_manager_class` (verl/trainer/ppo/ray_trainer.py), builds it with
`(config, worker_group, rollout_resource_pool, rm_resource_pool)`, reads `rollout_replicas`, and
calls `generate_sequences(gen_batch)` once per step with the prompts repeated `rollout.n` times,
interleaved; the DataProto it returns is `union`ed row by row with the step's batch, so it has the
same rows in the same order, the tensors AgentLoopWorker._postprocess makes (verl/experimental/
agent_loop/agent_loop.py: prompts left-padded to `rollout.prompt_length`, responses, response_mask,
rollout_log_probs right-padded to `rollout.response_length`, input_ids, attention_mask,
position_ids, rm_scores with the reward on the last response token), `__num_turns__` and
`multi_modal_inputs` per row, and `meta_info["timing"]`.

Configured by environment variables, as rollout_client.slime: ROLLOUT_SERVICE_URL, ROLLOUT_ENV,
and optionally ROLLOUT_API_KEY, ROLLOUT_TASK_SPLIT (default `train`), ROLLOUT_EVAL_TASK_SPLIT
(default `test`, verl's validation), ROLLOUT_MAX_TURNS, ROLLOUT_RUN_ID (names the run's batches;
by default a hash of the trainer's project, experiment and model). A row's task is
`extra_info["task_index"]`, else verl's `index` (the dataset's `extra_info.index`).

verl has no row it can leave out: an episode that failed, was aborted or cancelled keeps its row
with response_mask all 0 (so no loss), and its rm_score is the mean of its group's trained rewards
(so it does not move the group's GRPO baseline); counted in meta_info["rollout_service"].
A response longer than `rollout.response_length` (the service caps the sampled tokens there, but
a tool result after the last turn can overrun) is cut with its mask and logprobs, and counted.

verl, torch and transformers are imported when the manager is used: this module imports without them.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache, partial
from typing import Any

import numpy as np
import numpy.typing as npt

from rollout_client.batch import EpisodeArrays
from rollout_client.client import RolloutClient
from rollout_client.steps import (
    TRAINABLE_STATUSES,
    ServiceConfig,
    StepBatch,
    StepCounts,
    digest,
    pull_step,
    rewards_for_grpo,
)

VERL_COMMIT = "b178a3cd56f58b2d502255daba591e92833930a7"


def _get(config: Any, name: str, default: Any = None) -> Any:
    """A field of an OmegaConf DictConfig (or any object with attributes), `default` if absent."""
    getter = getattr(config, "get", None)
    if callable(getter):
        return getter(name, default)
    return getattr(config, name, default)


@dataclass(frozen=True)
class VerlShape:
    """What verl's config says about a step's tensors."""

    prompt_length: int
    response_length: int
    pad_token_id: int


@dataclass
class VerlArrays:
    """A step's rows as verl's agent loop makes them, as numpy arrays (torch tensors at the edge)."""

    tensors: dict[str, npt.NDArray[Any]]
    non_tensors: dict[str, npt.NDArray[Any]]


def group_runs(keys: Sequence[Any]) -> list[tuple[int, int]]:
    """(start, length) of each run of equal consecutive keys: verl repeats each prompt `n` times
    interleaved, so a run is one prompt's group (validation pads with copies: runs may be shorter)."""
    runs: list[tuple[int, int]] = []
    for row, key in enumerate(keys):
        if runs and keys[runs[-1][0]] == key:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((row, 1))
    return runs


def task_of_row(non_tensors: Mapping[str, Any], row: int) -> int:
    extra = non_tensors.get("extra_info")
    if extra is not None and isinstance(extra[row], Mapping) and "task_index" in extra[row]:
        return int(extra[row]["task_index"])
    if "index" in non_tensors:
        return int(non_tensors["index"][row])
    if extra is not None and isinstance(extra[row], Mapping) and "index" in extra[row]:
        return int(extra[row]["index"])
    raise ValueError("a verl row needs extra_info.task_index or index (the dataset's extra_info.index)")


def _positions(
    width: int, rows: npt.NDArray[np.int64], starts: npt.NDArray[np.int64], lengths: npt.NDArray[np.int64]
) -> npt.NDArray[np.int64]:
    """Flat (row-major) positions, in a (n, width) array, of `lengths[i]` columns from `starts[i]` in
    row `rows[i]`: where the rows' parts, concatenated, go."""
    before = np.cumsum(lengths) - lengths
    row_starts = rows * width + starts
    return np.repeat(row_starts - before, lengths) + np.arange(int(lengths.sum()), dtype=np.int64)


def _objects(values: list[Any]) -> npt.NDArray[Any]:
    array = np.empty(len(values), dtype=object)
    array[:] = values
    return array


class VerlRows:
    """A step's tensors as verl's AgentLoopWorker._postprocess makes them, one row per episode,
    filled page by page as the groups come: a page's rows are written while the next groups still
    run (as slime's hook fills its samples), so that only the last page's rows are left to fill once
    the step's last group is in. Each fill is a handful of numpy calls over the page's tokens and
    rows, not several per row (a trainer's thread waits for the GIL after each numpy copy, which
    releases it). The dense tensors (rows x (prompt + response length)) are allocated at the first
    fill, not before the step's POST."""

    def __init__(self, size: int, shape: VerlShape) -> None:
        self.size, self.shape = size, shape
        self.episodes: list[EpisodeArrays | None] = [None] * size
        self.tensors: dict[str, npt.NDArray[Any]] = {}

    def _allocate(self) -> None:
        size, pad = self.size, self.shape.pad_token_id
        plen, rlen = self.shape.prompt_length, self.shape.response_length
        self.tensors = {
            "prompts": np.full((size, plen), pad, dtype=np.int64),
            "responses": np.full((size, rlen), pad, dtype=np.int64),
            "response_mask": np.zeros((size, rlen), dtype=np.int64),
            "input_ids": np.full((size, plen + rlen), pad, dtype=np.int64),
            "attention_mask": np.zeros((size, plen + rlen), dtype=np.int64),
            "position_ids": np.zeros((size, plen + rlen), dtype=np.int64),
            "rollout_log_probs": np.zeros((size, rlen), dtype=np.float32),
            "rm_scores": np.zeros((size, rlen), dtype=np.float32),
        }  # fmt: skip

    def fill(
        self,
        rows: Sequence[int],
        episodes: Sequence[EpisodeArrays],
        rewards: Sequence[float],
        counts: StepCounts,
    ) -> None:
        """Writes `episodes[i]` with `rewards[i]` at row `rows[i]`."""
        count, plen, rlen = len(episodes), self.shape.prompt_length, self.shape.response_length
        if not count:
            return
        prompt_lengths = np.fromiter((len(e.prompt_ids) for e in episodes), dtype=np.int64, count=count)
        if prompt_lengths.max() > plen:
            episode = episodes[int(prompt_lengths.argmax())]
            raise ValueError(
                f"episode {episode.episode_id}'s prompt has {len(episode.prompt_ids)} tokens, more than "
                f"actor_rollout_ref.rollout.prompt_length={plen}: raise it (verl never cuts a prompt)"
            )
        if not self.tensors:
            self._allocate()
        at = np.asarray(rows, dtype=np.int64)
        lengths = np.fromiter((len(e.response_ids) for e in episodes), dtype=np.int64, count=count)
        kept = np.minimum(lengths, rlen)
        trained = np.fromiter((e.status in TRAINABLE_STATUSES for e in episodes), dtype=bool, count=count)
        counts.cut += int((lengths > rlen).sum())
        counts.masked += int(count - trained.sum())
        cuts = kept.tolist()
        t = self.tensors
        starts = plen - prompt_lengths
        t["input_ids"].reshape(-1)[_positions(plen + rlen, at, starts, prompt_lengths)] = np.concatenate(
            [e.prompt_ids for e in episodes]
        )
        sampled = _positions(rlen, at, np.zeros(count, dtype=np.int64), kept)
        if sampled.size:
            responses = np.concatenate([e.response_ids[:k] for e, k in zip(episodes, cuts, strict=True)])
            t["input_ids"].reshape(-1)[_positions(plen + rlen, at, np.full(count, plen), kept)] = responses
            t["responses"].reshape(-1)[sampled] = responses
            t["rollout_log_probs"].reshape(-1)[sampled] = np.concatenate(
                [e.rollout_logprobs[:k] for e, k in zip(episodes, cuts, strict=True)]
            )
            t["response_mask"].reshape(-1)[sampled] = np.concatenate([
                e.loss_mask[:k] if trained_ else np.zeros(k, np.uint8)
                for e, k, trained_ in zip(episodes, cuts, trained, strict=True)
            ])  # fmt: skip
        t["prompts"][at] = t["input_ids"][at, :plen]
        # Attended: the left-padded prompt, then the response (one masked pad token if nothing was
        # sampled, so that the row has a last token for its reward).
        response_lengths = np.maximum(kept, 1)
        t["rm_scores"][at, response_lengths - 1] = rewards
        attended = prompt_lengths + response_lengths
        t["attention_mask"].reshape(-1)[_positions(plen + rlen, at, starts, attended)] = 1
        # verl's compute_position_id_with_mask (the attention mask's cumsum, from 0, clipped at 0) is,
        # on such a row, the column less the prompt's padding, clipped to [0, attended - 1].
        positions = np.subtract(np.arange(plen + rlen, dtype=np.int64), starts[:, None])
        t["position_ids"][at] = np.clip(positions, 0, (attended - 1)[:, None], out=positions)
        for row, episode in zip(rows, episodes, strict=True):
            self.episodes[row] = episode

    def arrays(self) -> VerlArrays:
        if any(episode is None for episode in self.episodes):
            raise RuntimeError("a verl row got no episode")
        rows = [episode for episode in self.episodes if episode is not None]
        if not self.tensors:
            self._allocate()
        rlen = self.shape.response_length
        non_tensors = {
            "__num_turns__": np.array([e.num_turns or 0 for e in rows], dtype=np.int32),
            "multi_modal_inputs": _objects([{} for _ in rows]),
            "episode_id": _objects([e.episode_id for e in rows]),
            "episode_status": _objects([e.status for e in rows]),
            "weight_versions": _objects([list(e.weight_versions) for e in rows]),
            "response_cut": np.array([len(e.response_ids) > rlen for e in rows], dtype=bool),
        }
        return VerlArrays(self.tensors, non_tensors)


def build_arrays(
    rows: Sequence[EpisodeArrays], rewards: Sequence[float], shape: VerlShape, counts: StepCounts
) -> VerlArrays:
    """The tensors of verl's AgentLoopWorker._postprocess for these episodes, one row each."""
    filled = VerlRows(len(rows), shape)
    filled.fill(range(len(rows)), rows, rewards, counts)
    return filled.arrays()


@cache
def _pad_token_id(model_path: str) -> int:
    from transformers import AutoTokenizer  # verl's environment has it

    tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=True)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return int(pad)


def _tensor(array: npt.NDArray[Any]) -> Any:
    import torch  # verl's environment has it

    return torch.from_numpy(array)


class RolloutServiceAgentLoopManager:
    """verl's AgentLoopManager, with the rollout service running each step's episodes. verl's own
    rollout replicas are not started: the service's engines serve the rollouts (`rollout_replicas`
    is empty, so verl's checkpoint manager syncs no weights: push them to the service's engines as
    examples/verl/README.md says)."""

    tensor = staticmethod(_tensor)  # numpy -> the trainer's tensor type

    def __init__(
        self,
        config: Any,
        worker_group: Any = None,
        rollout_resource_pool: Any = None,
        rm_resource_pool: Any = None,
        *,
        service: ServiceConfig | None = None,
    ) -> None:
        self.config = config
        self.worker_group = worker_group
        self.rollout_replicas: list[Any] = []
        self.service = service or ServiceConfig.from_env(adapter="verl")
        rollout = config.actor_rollout_ref.rollout
        model_path = str(config.actor_rollout_ref.model.path)
        self.shape = VerlShape(
            int(rollout.prompt_length), int(rollout.response_length), _pad_token_id(model_path)
        )
        self.run_id = self.service.run_id or "verl-" + digest([
            _get(config.trainer, "project_name"), _get(config.trainer, "experiment_name"), model_path,
            self.service.env, self.service.task_split,
        ])  # fmt: skip

    def sampling_params(self, validate: bool) -> dict[str, Any]:
        """verl's AgentLoopWorker.generate_sequences' params (val_kwargs for validation); per turn at
        most the response length, which is also the episode's token budget."""
        rollout = self.config.actor_rollout_ref.rollout
        source = rollout.val_kwargs if validate else rollout
        return {
            "temperature": source.temperature,
            "top_p": source.top_p,
            "top_k": source.top_k,
            "repetition_penalty": 1.0,
            "max_new_tokens": self.shape.response_length,
        }

    def generate_sequences(self, prompts: Any) -> Any:
        """verl's step: the rows' groups from the service, as verl's agent loop returns them."""
        from verl.protocol import DataProto

        started = time.monotonic()
        validate = bool(prompts.meta_info.get("validate", False))
        step = int(prompts.meta_info.get("global_steps", -1))
        non_tensors = prompts.non_tensor_batch
        runs = group_runs(list(non_tensors["uid"] if "uid" in non_tensors else non_tensors["index"]))
        tasks = [task_of_row(non_tensors, start) for start, _ in runs]
        counts = StepCounts()
        filled = VerlRows(len(prompts), self.shape)

        def fill(groups: dict[int, list[EpisodeArrays]], *, chosen: list[int]) -> None:
            rows: list[int] = []
            episodes: list[EpisodeArrays] = []
            rewards: list[float] = []
            for group, group_episodes in groups.items():
                start = runs[chosen[group]][0]
                rows += range(start, start + len(group_episodes))
                episodes += group_episodes
                rewards += rewards_for_grpo(group_episodes)
            filled.fill(rows, episodes, rewards, counts)

        with RolloutClient(self.service.url, self.service.api_key) as client:  # one pool per step
            # One service batch per group size: verl's validation pads its batch with copies of rows.
            for size in sorted({length for _, length in runs}):
                chosen = [index for index, (_, length) in enumerate(runs) if length == size]
                step_batch = self.step_batch(client, [tasks[index] for index in chosen], size, step, validate)
                pull_step(client, step_batch, counts, partial(fill, chosen=chosen))
        arrays = filled.arrays()
        return DataProto.from_dict(
            tensors={name: self.tensor(array) for name, array in arrays.tensors.items()},
            non_tensors=arrays.non_tensors,
            meta_info={
                "timing": {"agent_loop/rollout_service/seconds": time.monotonic() - started},
                "rollout_service": counts.metrics(),
                "reward_extra_keys": [],
            },
        )

    def step_batch(
        self, client: RolloutClient, tasks: list[int], samples: int, step: int, validate: bool
    ) -> StepBatch:
        """The service batch of a step's groups of one size; its id is the step's (in the key's
        scope), so a restarted trainer asking for the same step gets the same episodes back."""
        return StepBatch(
            batch_id=client.batch_id(
                self.run_id, "val" if validate else "train", step, f"n{samples}", digest(tasks)
            ),
            env=self.service.env,
            tasks=tasks,
            samples=samples,
            task_split=self.service.eval_task_split if validate else self.service.task_split,
            sampling_params=self.sampling_params(validate),
            max_turns=self.service.max_turns,
            max_response_tokens=self.shape.response_length,
            metadata={"verl_step": step, "verl_validate": validate},
        )

    # AgentLoopManager's other methods, called by RayPPOTrainer: nothing to do beside the service.
    def clear_kv_cache(self) -> None:
        pass

    def start_profile(self, **kwargs: Any) -> None:
        pass

    def stop_profile(self) -> None:
        pass
