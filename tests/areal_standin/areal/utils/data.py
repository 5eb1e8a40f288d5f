"""areal/utils/data.py: concat_padded_tensors, numpy for torch."""

from __future__ import annotations

from typing import Any

import numpy as np


def concat_padded_tensors(tensor_dicts: list[dict[str, Any]], pad_value: float = 0.0) -> dict[str, Any]:
    """Arrays right-padded to the longest along dim 1, concatenated along dim 0; attention_mask is
    always padded with 0 (False); list values flat-concatenated; others: the first dict's."""
    if not tensor_dicts:
        return {}
    if len(tensor_dicts) == 1:
        return dict(tensor_dicts[0])
    first_keys = set(tensor_dicts[0])
    for i, d in enumerate(tensor_dicts[1:], 1):
        if set(d) != first_keys:
            raise ValueError(f"concat_padded_tensors: dict[{i}] has different keys than dict[0]")
    result: dict[str, Any] = {}
    for key in tensor_dicts[0]:
        values = [d[key] for d in tensor_dicts]
        if isinstance(values[0], np.ndarray):
            pad = 0 if key == "attention_mask" else pad_value
            if values[0].ndim >= 2:
                width = max(v.shape[1] for v in values)
                values = [
                    np.pad(
                        v, [(0, 0), (0, width - v.shape[1])] + [(0, 0)] * (v.ndim - 2), constant_values=pad
                    )
                    for v in values
                ]
            result[key] = np.concatenate(values, axis=0)
        elif isinstance(values[0], list):
            result[key] = [item for v in values for item in v]
        else:
            result[key] = values[0]
    return result
