"""The environments this service can run: the built-in ones, tau-bench's and tau2-bench's when
they are installed, and plugins' (packages' entry points, and the ENV_PLUGINS setting's loaders)."""

from __future__ import annotations

import importlib.util

from service.envs import plugins, tau2, tau2_data
from service.envs.base import EnvSpec
from service.envs.tau import airline_env, retail_env

TAU2_FACTORIES = {
    "retail": tau2.retail_env,
    "airline": tau2.airline_env,
    "telecom": tau2.telecom_env,
    "mock": tau2.mock_env,
}

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


TAU2_DESCRIPTIONS = {
    "retail": "tau2-bench retail: orders, returns, exchanges; tau2's user simulator (USER_SIM_*); "
    "its NL_ASSERTION tasks need an LLM judge (JUDGE_*).",
    "airline": "tau2-bench airline: reservations, changes, baggage; tau2's user simulator (USER_SIM_*).",
    "telecom": "tau2-bench telecom, dual control: the simulated user (USER_SIM_*) has tools of its own "
    "on its phone; rewarded on the final state (ENV_ASSERTION).",
    "mock": "tau2-bench's mock domain (tasks and users), for tests.",
}


def tau2_envs() -> list[EnvSpec]:
    """tau2-bench's domains as its data folder holds them (read at start: no tau2 import): every
    split listed with its size, those that lack a data file in `unavailable`."""
    root = tau2_data.data_dir()
    if root is None:
        return []
    specs = []
    for domain in tau2_data.TAU2_DOMAINS:
        data = tau2_data.read_domain(root, domain)
        specs.append(
            EnvSpec(
                name=f"tau2/{domain}",
                splits={split: len(ids) for split, ids in data.splits.items()},
                description=TAU2_DESCRIPTIONS[domain],
                factory=TAU2_FACTORIES[domain],
                unavailable=data.unavailable,
                judged_tasks=data.judged,
            )
        )
    return specs


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


def available_envs(loaders: tuple[str, ...] | list[str] = ()) -> dict[str, EnvSpec]:
    """Every environment by name: the built-in ones always, tau-bench's if `tau_bench` is importable,
    tau2-bench's if its `tau2` is, then those of installed plugins (entry points) and of `loaders`
    (`module:function`, the ENV_PLUGINS setting). A plugin that fails is listed unavailable, with
    its error; it never stops the service."""
    specs = builtin_envs()
    if tau_bench_installed():
        specs.extend(TAU_BENCH_ENVS)
    if tau2_data.tau2_installed():
        specs.extend(tau2_envs())
    catalog = {spec.name: spec for spec in specs}
    plugins.add_plugins(catalog, plugins.entry_point_sources())
    return with_loaders(catalog, loaders)


def with_loaders(catalog: dict[str, EnvSpec], loaders: tuple[str, ...] | list[str]) -> dict[str, EnvSpec]:
    """`catalog` with the specs of `loaders` (`module:function`, the ENV_PLUGINS setting) added."""
    plugins.add_plugins(catalog, plugins.loader_sources(loaders))
    return catalog
