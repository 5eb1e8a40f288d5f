"""areal/api/workflow_api.py: the rollout workflow's contract."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any


class RolloutWorkflow(ABC):
    @abstractmethod
    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> dict[str, Any] | None:
        """One trajectory (a dict of [batch, seqlen] arrays, `rewards` [batch]), or None (rejected)."""
        raise NotImplementedError()
