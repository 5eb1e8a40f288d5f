from areal.api.workflow_api import RolloutWorkflow

__all__ = ["RolloutWorkflow"]
