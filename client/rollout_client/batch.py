"""A batch's Arrow stream, decoded for a trainer: per-episode numpy views of the token columns.

Each token column (a list column) is flattened once into one numpy array over the Arrow buffer,
and an episode's array is a slice of it: no Python object per token.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

TOKEN_COLUMNS = ("prompt_ids", "response_ids", "loss_mask", "rollout_logprobs")
# Trained on: the policy's own episodes. An aborted episode (the engine refused it, or the policy's
# output could not be parsed) and a failed or cancelled one (infrastructure, or nobody's) are not.
# The service's `trainable` column says the same per row.
TRAINABLE_STATUSES = frozenset({"completed", "truncated"})


@dataclass(frozen=True)
class EpisodeArrays:
    """One episode of a batch: its scalars and its token arrays (views into the batch's columns)."""

    episode_id: str
    batch_id: str
    group_index: int
    sample_index: int
    task_index: int
    status: str
    reward: float | None
    attempt: int
    num_turns: int | None
    prompt_ids: npt.NDArray[np.int32]
    response_ids: npt.NDArray[np.int32]
    loss_mask: npt.NDArray[np.uint8]
    rollout_logprobs: npt.NDArray[np.float64]
    weight_versions: list[str | None]  # per generate call
    finish_reasons: list[str | None]  # per generate call
    error: str | None
    messages_json: str = field(repr=False)
    info_json: str = field(repr=False)
    # The Arrow list scalar of the episode's token_weight_versions, or the JSON list.
    token_versions: pa.ListScalar | list[str | None] | None = field(default=None, repr=False)
    # An external agent that rewrote its history has several segments, each a training sample
    # (a row) of its own with the episode's id, reward and status.
    segment: int = 0
    segments: int = 1
    # Train on it: completed or truncated. False (failed, aborted, cancelled): drop or mask the row,
    # never train on it as reward 0 (the service says so per row, as the trainer adapters decide).
    trainable: bool = True

    def __repr__(self) -> str:  # the token arrays would fill a screen
        return (
            f"EpisodeArrays({self.episode_id!r}, batch {self.batch_id!r}, group {self.group_index} "
            f"sample {self.sample_index}, {self.status}{'' if self.trainable else ' (not trainable)'}, "
            f"reward {self.reward}, {len(self.prompt_ids)} prompt + {len(self.response_ids)} response "
            f"tokens ({int(self.loss_mask.sum())} sampled), {self.num_turns} turns)"
        )

    @cached_property
    def token_weight_versions(self) -> list[str | None]:
        """Per response token, the weight version that sampled it (None: not sampled)."""
        if isinstance(self.token_versions, list):
            return self.token_versions
        if self.token_versions is None or not self.token_versions.is_valid:
            return [None] * len(self.response_ids)
        versions: list[str | None] = self.token_versions.as_py()
        return versions

    @classmethod
    def from_detail(cls, episode: dict[str, Any]) -> EpisodeArrays:
        """An episode as GET /episodes/{id} answers it (JSON)."""

        def numbers(name: str, dtype: type[np.generic]) -> Any:
            return np.asarray(episode.get(name) or [], dtype=dtype)

        return cls(
            episode_id=episode["id"],
            batch_id=episode["batch_id"],
            group_index=episode["group_index"],
            sample_index=episode["sample_index"],
            task_index=episode["task_index"],
            status=episode["status"],
            reward=episode["reward"],
            attempt=episode["attempt"],
            num_turns=episode["num_turns"],
            prompt_ids=numbers("prompt_ids", np.int32),
            response_ids=numbers("response_ids", np.int32),
            loss_mask=numbers("loss_mask", np.uint8),
            rollout_logprobs=numbers("rollout_logprobs", np.float64),
            weight_versions=episode["weight_versions"],
            finish_reasons=[(reason or {}).get("type") for reason in episode["finish_reasons"]],
            error=episode["error"],
            messages_json=json.dumps(episode["messages"]),
            info_json=json.dumps(episode["info"]),
            token_versions=episode.get("token_weight_versions"),
            segment=episode.get("segment", 0),
            segments=episode.get("segments", 1),
            trainable=episode.get("trainable", episode["status"] in TRAINABLE_STATUSES),
        )

    @cached_property
    def messages(self) -> list[dict[str, Any]] | None:
        value: list[dict[str, Any]] | None = json.loads(self.messages_json)
        return value

    @cached_property
    def info(self) -> dict[str, Any] | None:
        value: dict[str, Any] | None = json.loads(self.info_json)
        return value


class _Flat:
    """A list column as (offsets, values): row i is values[offsets[i]:offsets[i + 1]]."""

    def __init__(self, column: pa.ChunkedArray) -> None:
        array = column.combine_chunks()
        self.offsets = array.offsets.to_numpy()
        values = array.values
        self.values = values.to_numpy(zero_copy_only=values.null_count == 0)

    def row(self, index: int) -> Any:
        return self.values[self.offsets[index] : self.offsets[index + 1]]


class Batch:
    """The episodes of a batch's complete groups, from the service's Arrow stream. Scalar columns
    are arrays over all episodes (`reward` is NaN where null); `batch[i]` is one episode."""

    def __init__(self, table: pa.Table) -> None:
        self.table = table
        self.episode_id: list[str] = table.column("episode_id").to_pylist()
        self.batch_id: list[str] = table.column("batch_id").to_pylist()
        self.status: list[str] = table.column("status").to_pylist()
        self.error: list[str | None] = table.column("error").to_pylist()
        self.group_index = self._numbers("group_index")
        self.sample_index = self._numbers("sample_index")
        self.task_index = self._numbers("task_index")
        self.attempt = self._numbers("attempt")
        self.num_turns = self._numbers("num_turns")
        self.reward = self._numbers("reward").astype(np.float64)
        self._rewards: list[float | None] = table.column("reward").to_pylist()
        self._turns: list[int | None] = table.column("num_turns").to_pylist()
        self._weight_versions: list[list[str | None] | None] = table.column("weight_versions").to_pylist()
        self._finish_reasons: list[list[str | None] | None] = table.column("finish_reasons").to_pylist()
        self._messages: list[str] = table.column("messages_json").to_pylist()
        self._info: list[str] = table.column("info_json").to_pylist()
        names = set(table.column_names)
        self._token_versions = (
            table.column("token_weight_versions").combine_chunks()
            if "token_weight_versions" in names
            else None
        )
        self._tokens = {name: _Flat(table.column(name)) for name in TOKEN_COLUMNS}
        self._segments: list[tuple[int, int]] = (
            list(zip(table.column("segment").to_pylist(), table.column("segments").to_pylist(), strict=True))
            if "segments" in names
            else [(0, 1)] * table.num_rows
        )
        self.trainable: list[bool] = (
            table.column("trainable").to_pylist()
            if "trainable" in names
            else [status in TRAINABLE_STATUSES for status in self.status]
        )

    def _numbers(self, name: str) -> npt.NDArray[Any]:
        numbers: npt.NDArray[Any] = self.table.column(name).to_numpy()
        return numbers

    def __len__(self) -> int:
        return int(self.table.num_rows)

    def __iter__(self) -> Iterator[EpisodeArrays]:
        return (self[index] for index in range(len(self)))

    def __getitem__(self, index: int) -> EpisodeArrays:
        if not -len(self) <= index < len(self):
            raise IndexError(f"episode {index} of a batch of {len(self)}")
        index %= len(self)
        tokens = {name: flat.row(index) for name, flat in self._tokens.items()}
        return EpisodeArrays(
            episode_id=self.episode_id[index],
            batch_id=self.batch_id[index],
            group_index=int(self.group_index[index]),
            sample_index=int(self.sample_index[index]),
            task_index=int(self.task_index[index]),
            status=self.status[index],
            reward=self._rewards[index],
            attempt=int(self.attempt[index]),
            num_turns=self._turns[index],
            weight_versions=self._weight_versions[index] or [],
            finish_reasons=self._finish_reasons[index] or [],
            error=self.error[index],
            messages_json=self._messages[index],
            info_json=self._info[index],
            token_versions=None if self._token_versions is None else self._token_versions[index],
            segment=self._segments[index][0],
            segments=self._segments[index][1],
            trainable=self.trainable[index],
            **tokens,
        )

    def without_cancelled_groups(self) -> Batch:
        """The batch less every group with a `cancelled` episode (its batch was cancelled before
        the group finished: no tokens to train on). The client's pulls do this unless asked not to."""
        cancelled = {
            (batch, group)
            for batch, group, status in zip(
                self.batch_id, self.group_index.tolist(), self.status, strict=True
            )
            if status == "cancelled"
        }
        if not cancelled:
            return self
        keep = [
            (batch, group) not in cancelled
            for batch, group in zip(self.batch_id, self.group_index.tolist(), strict=True)
        ]
        return Batch(self.table.filter(pa.array(keep, pa.bool_())))

    def groups(self) -> dict[int, list[EpisodeArrays]]:
        """Episodes by group index, each group in sample order."""
        groups: dict[int, list[EpisodeArrays]] = {}
        for index in np.lexsort((self.sample_index, self.group_index)):
            episode = self[int(index)]
            groups.setdefault(episode.group_index, []).append(episode)
        return groups


def read_table(body: bytes) -> pa.Table:
    """An Arrow IPC stream (the service's batch pull) as a Table."""
    return pa.ipc.open_stream(body).read_all()
