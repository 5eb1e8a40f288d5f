"""The environments this service can run: the built-in ones, plus tau-bench's when it is installed."""

from __future__ import annotations

import importlib.util

from service.envs.base import EnvSpec
from service.envs.tau import airline_env, retail_env

# Task counts per split, from tau-bench 0.1.0 (HEAD 59a200c): listing them must not import
# tau_bench (it imports litellm, ~3 s). The adapter checks indexes against the real task lists.
TAU_BENCH_ENVS = (
    EnvSpec(
        name="tau-bench/retail",
        splits={"train": 500, "test": 115, "dev": 20},
        description="tau-bench retail customer service: orders, returns, exchanges; "
        "an LLM-simulated user (USER_SIM_*).",
        factory=retail_env,
    ),
    EnvSpec(
        name="tau-bench/airline",
        splits={"test": 50},
        description="tau-bench airline customer service: reservations, changes, baggage; "
        "an LLM-simulated user (USER_SIM_*).",
        factory=airline_env,
    ),
)


def tau_bench_installed() -> bool:
    return importlib.util.find_spec("tau_bench") is not None


def builtin_envs() -> list[EnvSpec]:
    try:
        from service.envs.builtin import BUILTIN_ENVS
    except ImportError as exc:
        raise ImportError(
            f"service.envs.builtin must define BUILTIN_ENVS: list[EnvSpec] (the built-in environments): {exc}"
        ) from exc
    return list(BUILTIN_ENVS)


def available_envs() -> dict[str, EnvSpec]:
    """Every environment by name: the built-in ones always, tau-bench's if `tau_bench` is importable."""
    specs = builtin_envs()
    if tau_bench_installed():
        specs.extend(TAU_BENCH_ENVS)
    return {spec.name: spec for spec in specs}
