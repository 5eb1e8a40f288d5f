"""slime.rollout.data_source.RolloutDataSource: prompts in order, as groups of copies."""

from __future__ import annotations

import copy
from typing import Any

from slime.utils.types import Sample


class RolloutDataSource:
    def __init__(self, args: Any, prompts: list[Sample]) -> None:
        self.args = args
        self.prompts = prompts  # slime reads them from --prompt-data (--input-key index: task indices)
        self.offset = 0
        self.sample_index = 0
        self.sample_group_index = 0

    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        groups = []
        for _ in range(num_samples):
            prompt = self.prompts[self.offset % len(self.prompts)]
            self.offset += 1
            group = []
            for _ in range(self.args.n_samples_per_prompt):
                sample = copy.deepcopy(prompt)
                sample.group_index = self.sample_group_index
                sample.index = self.sample_index
                self.sample_index += 1
                group.append(sample)
            self.sample_group_index += 1
            groups.append(group)
        return groups
