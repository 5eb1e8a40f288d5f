"""areal/infra/workflow_executor.py: check_trajectory_format, numpy for torch."""

from __future__ import annotations

from typing import Any

import numpy as np


def check_trajectory_format(
    data: dict[str, Any] | None, batch_size: int | None = None, expected_keys: set[str] | None = None
) -> bool:
    if data is None:
        return True
    if not isinstance(data, dict):
        raise ValueError(f"Expected data to be None or dict, got {type(data)}")
    if len(data) == 0:
        raise ValueError("Data dict cannot be empty")
    missing = {"input_ids", "attention_mask"} - set(data)
    if missing:
        raise ValueError(f"Missing required keys in tensor data: {missing}")
    input_ids = data["input_ids"]
    if input_ids.ndim != 2:
        raise ValueError(f"Expected 2D tensors with shape [batch_size, max_seqlen], got {input_ids.ndim}D")
    inferred_batch_size, max_seqlen = input_ids.shape
    if batch_size is not None and inferred_batch_size != batch_size:
        raise ValueError(f"Expected batch size {batch_size}, got {inferred_batch_size}")
    for key, value in data.items():
        # AReaL logs a warning for these; the stand-in is stricter, a test should see them.
        assert isinstance(value, np.ndarray), f"{key} is not a tensor"
        assert value.shape[0] == inferred_batch_size, f"the first dim of {key} is {value.shape[0]}"
        if value.ndim >= 2:
            assert value.shape[1] == max_seqlen, f"the second dim of {key} is {value.shape[1]}"
    if expected_keys is not None and expected_keys - set(data):
        raise ValueError(f"Inconsistent keys: {expected_keys - set(data)} are missing")
    return True
