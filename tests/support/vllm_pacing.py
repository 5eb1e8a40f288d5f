"""A logits processor for the real vLLM of tests/test_vllm_real.py, loaded into vLLM's own
virtualenv with `--logits-processors` (so it imports vLLM and nothing of the service or the
tests): an engine step that samples for a request seeded with ROLLOUT_TEST_PACED_SEED first waits
ROLLOUT_TEST_PACE_SECONDS. Such a turn takes at least its length times that, on a quiet machine as
on a loaded one, and its logits are left as they are.

Why: the pause and abort tests must find a call mid-generation, and they see its progress on the
/metrics of vLLM's API server, which on a loaded machine lags the engine by hundreds of tokens (the
engine-core process samples while the API server waits for a core): unpaced, the tiny model's
whole turn was sampled before the test saw its first token."""

from __future__ import annotations

import os
import time
from typing import Any

from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality


class Pacer(LogitsProcessor):
    def __init__(self, vllm_config: Any, device: Any, is_pin_memory: bool) -> None:
        self.seed = int(os.environ["ROLLOUT_TEST_PACED_SEED"])
        self.pace_seconds = float(os.environ["ROLLOUT_TEST_PACE_SECONDS"])
        self.paced: set[int] = set()  # the batch indices of paced requests

    def is_argmax_invariant(self) -> bool:
        return False  # applied to greedy batches too

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:  # in vLLM's order: removed, added, moved
            self.paced.discard(index)
        for index, params, _, _ in batch_update.added:
            if params is not None and params.seed == self.seed:
                self.paced.add(index)
            else:
                self.paced.discard(index)
        for first, second, direction in batch_update.moved:
            first_paced, second_paced = first in self.paced, second in self.paced
            self.paced -= {first, second}
            if first_paced:
                self.paced.add(second)
            if second_paced and direction == MoveDirectionality.SWAP:
                self.paced.add(first)

    def apply(self, logits: Any) -> Any:
        if self.paced:
            time.sleep(self.pace_seconds)
        return logits
