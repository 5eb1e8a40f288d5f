"""An example environment plugin: the entry point `rollout_service.envs` names `env_specs`."""

from __future__ import annotations

from helpdesk_env.desk import SPLIT_SIZES, make_env
from service.envs.api import EnvSpec

__all__ = ["env_specs"]


def env_specs() -> list[EnvSpec]:
    """What the service lists: cheap (no task is generated here), called in every service process."""
    return [
        EnvSpec(
            name="helpdesk/it-support",
            splits=dict(SPLIT_SIZES),
            description="Example plugin: an IT help desk (unlock accounts, reset passwords, file tickets); "
            "scripted user; reward 1 when the final state matches the ground truth.",
            factory=make_env,
            train_split="train",
        )
    ]
