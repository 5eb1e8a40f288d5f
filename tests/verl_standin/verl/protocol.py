"""verl.protocol.DataProto, the parts the trainer's step and the agent-loop manager use; numpy
arrays where verl has torch tensors (a TensorDict)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


def _deep_equal(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return a.shape == b.shape and all(
            _deep_equal(x, y) for x, y in zip(a.tolist(), b.tolist(), strict=True)
        )
    return bool(a == b)


@dataclass
class DataProto:
    batch: dict[str, np.ndarray] | None = None
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        sizes = {len(value) for value in (self.batch or {}).values()}
        sizes |= {len(value) for value in self.non_tensor_batch.values()}
        assert len(sizes) <= 1, f"batch sizes differ: {sizes}"
        for key, value in (self.batch or {}).items():
            assert isinstance(value, np.ndarray) and value.dtype != object, f"{key} is not a tensor"
        for key, value in self.non_tensor_batch.items():
            assert isinstance(value, np.ndarray), f"non-tensor {key} is not an np.ndarray"

    def __len__(self) -> int:
        if self.batch:
            return len(next(iter(self.batch.values())))
        if self.non_tensor_batch:
            return len(next(iter(self.non_tensor_batch.values())))
        return 0

    @classmethod
    def from_dict(
        cls,
        tensors: dict[str, np.ndarray] | None = None,
        non_tensors: dict[str, np.ndarray] | None = None,
        meta_info: dict[str, Any] | None = None,
    ) -> DataProto:
        assert tensors, "tensors must not be empty"
        return cls(dict(tensors), dict(non_tensors or {}), dict(meta_info or {}))

    @classmethod
    def from_single_dict(cls, data: dict[str, Any], meta_info: dict[str, Any] | None = None) -> DataProto:
        tensors = {k: v for k, v in data.items() if isinstance(v, np.ndarray) and v.dtype != object}
        non_tensors = {k: v for k, v in data.items() if k not in tensors}
        return cls(tensors, non_tensors, dict(meta_info or {}))

    def pop(
        self, batch_keys: list[str] | None = None, non_tensor_batch_keys: list[str] | None = None
    ) -> DataProto:
        tensors = {key: (self.batch or {}).pop(key) for key in batch_keys or []}
        non_tensors = {key: self.non_tensor_batch.pop(key) for key in non_tensor_batch_keys or []}
        return DataProto(tensors, non_tensors, dict(self.meta_info))

    def repeat(self, repeat_times: int = 2, interleave: bool = True) -> DataProto:
        assert interleave
        tensors = {k: np.repeat(v, repeat_times, axis=0) for k, v in (self.batch or {}).items()}
        non_tensors = {k: np.repeat(v, repeat_times, axis=0) for k, v in self.non_tensor_batch.items()}
        return DataProto(tensors, non_tensors, dict(self.meta_info))

    def union(self, other: DataProto) -> DataProto:
        assert len(self) == len(other), (
            f"Two tensor dict must have identical batch size: {len(self)}, {len(other)}"
        )
        for key, value in (other.batch or {}).items():
            if self.batch is not None and key in self.batch:
                assert np.array_equal(self.batch[key], value), f"{key} differs"
            self.batch = {**(self.batch or {}), key: value}
        for key, value in other.non_tensor_batch.items():
            if key in self.non_tensor_batch:
                assert _deep_equal(self.non_tensor_batch[key], value), f"`{key}` differs"
            self.non_tensor_batch[key] = value
        for key, value in other.meta_info.items():
            if key in self.meta_info:
                assert self.meta_info[key] == value, f"meta_info {key} differs"
            self.meta_info[key] = value
        return self
