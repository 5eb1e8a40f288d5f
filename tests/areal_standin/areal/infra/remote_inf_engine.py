"""areal/infra/remote_inf_engine.py: how the trainer's rollout runs a workflow (rollout_batch,
_resolve_workflow, GroupedRolloutWorkflow); numpy for torch, no inference server."""

from __future__ import annotations

import asyncio
import importlib
import logging
from typing import Any

from areal.api.workflow_api import RolloutWorkflow
from areal.infra.workflow_executor import check_trajectory_format
from areal.utils.data import concat_padded_tensors

logger = logging.getLogger("RemoteInfEngine")


def import_from_string(path: str) -> Any:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


class GroupedRolloutWorkflow(RolloutWorkflow):
    def __init__(self, workflow: RolloutWorkflow, group_size: int, logger: logging.Logger):
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        self.workflow = workflow
        self.group_size = group_size
        self.logger = logger

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> dict[str, Any] | None:
        results = await asyncio.gather(
            *[self.workflow.arun_episode(engine, data) for _ in range(self.group_size)]
        )
        valid_results = [r for r in results if r is not None]
        if not valid_results:
            return None
        if len(valid_results) < len(results):
            self.logger.warning(
                f"GroupedRolloutWorkflow: {len(results) - len(valid_results)}/{len(results)} "
                "trajectories returned None, using remaining results"
            )
        return concat_padded_tensors(valid_results) or None


class RemoteInfEngine:
    def __init__(self) -> None:
        self._version = 0

    def set_version(self, version: int) -> None:
        self._version = version

    def get_version(self) -> int:
        return self._version

    def _resolve_workflow(
        self, workflow: Any, workflow_kwargs: dict[str, Any] | None, group_size: int = 1
    ) -> RolloutWorkflow:
        if isinstance(workflow, RolloutWorkflow):
            resolved = workflow
        else:
            imported = import_from_string(workflow) if isinstance(workflow, str) else workflow
            if not (isinstance(imported, type) and issubclass(imported, RolloutWorkflow)):
                raise ValueError(
                    f"{workflow!r} is not a RolloutWorkflow (the stand-in has no agent workflows)"
                )
            if workflow_kwargs is None:
                raise ValueError("workflow_kwargs is required when workflow is a class or string.")
            resolved = imported(**workflow_kwargs)
        if group_size > 1:
            resolved = GroupedRolloutWorkflow(resolved, group_size, logger)
        return resolved

    def rollout_batch(
        self,
        data: list[dict[str, Any]],
        workflow: Any,
        workflow_kwargs: dict[str, Any] | None = None,
        group_size: int = 1,
    ) -> list[dict[str, Any]]:
        """One trajectory dict per accepted item, each item's workflow run concurrently."""
        resolved = self._resolve_workflow(workflow, workflow_kwargs, group_size)

        async def run() -> list[dict[str, Any] | None]:
            return list(await asyncio.gather(*[resolved.arun_episode(self, item) for item in data]))

        results = asyncio.run(run())
        for result in results:
            check_trajectory_format(result)
        return [result for result in results if result is not None]
