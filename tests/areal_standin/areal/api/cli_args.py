"""areal/api/cli_args.py: GenerationHyperparameters, the fields a workflow reads."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any


@dataclass
class GenerationHyperparameters:
    n_samples: int = 1
    max_new_tokens: int = 16384
    min_new_tokens: int = 0
    max_tokens: int = 65536
    greedy: bool = False
    top_p: float = 1.0
    top_k: int = int(1e8)
    temperature: float = 1.0
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] | None = None
    frequency_penalty: float = 0.0

    def new(self, **kwargs: Any) -> GenerationHyperparameters:
        return replace(self, **kwargs)
