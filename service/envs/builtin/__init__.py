"""Environments that ship with the service, for the demo, tests and benchmarks."""

from service.envs.base import EnvSpec
from service.envs.builtin.shop import SPLIT_SIZES, make_shop_env

BUILTIN_ENVS = [
    EnvSpec(
        name="builtin/shop",
        splits=dict(SPLIT_SIZES),
        description="A small tau-bench-like retail domain: look up users and orders, cancel orders, "
        "change addresses; scripted user; reward 1 when the final database matches the ground truth.",
        factory=make_shop_env,
    )
]
