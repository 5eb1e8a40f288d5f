"""openrlhf/utils/agent.py: the agent executor's contract."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any


class AgentExecutorBase(ABC):
    @abstractmethod
    async def execute(
        self,
        prompt: Any,
        label: Any,
        sampling_params: Any,
        max_length: int,
        hf_tokenizer: Any,
        llm_engine: Any,
        images: Any = None,
    ) -> dict[str, Any]:
        raise NotImplementedError("AgentExecutorBase.execute is not implemented")
