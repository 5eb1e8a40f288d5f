"""slime's DAPO filter: keep a group only if its rewards differ."""

from __future__ import annotations

from typing import Any

import numpy as np

from slime.rollout.filter_hub.base_types import DynamicFilterOutput
from slime.utils.types import Sample


def check_reward_nonzero_std(args: Any, samples: list[Sample], **kwargs: Any) -> DynamicFilterOutput:
    rewards = [sample.get_reward_value(args) for sample in samples]
    keep = bool(np.std(np.asarray(rewards, dtype=np.float64), ddof=1) > 1e-6)
    return DynamicFilterOutput(keep=keep, reason=None if keep else f"zero_std_{round(rewards[0], 1)}")
