from __future__ import annotations

from tau_bench.envs.base import Env


def get_env(
    env_name: str,
    user_strategy: str,
    user_model: str,
    task_split: str,
    user_provider: str | None = None,
    task_index: int | None = None,
) -> Env:
    if env_name not in ("retail", "airline"):
        raise ValueError(f"Unknown environment: {env_name}")
    from tau_bench.envs.shop import ShopEnv

    return ShopEnv(env_name, user_strategy, user_model, task_split, user_provider, task_index)
