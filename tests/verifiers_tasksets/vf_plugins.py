"""The ENV_PLUGINS loader of tests/test_verifiers_envs.py (and bench/verifiers_envs.py): the two test
tasksets as service envs. It imports nothing but the service's env API (a plugin's listing costs
start-up time in every service process)."""

from __future__ import annotations

from service.envs.api import EnvSpec
from service.envs.verifiers_envs import verifiers_env


def env_specs() -> list[EnvSpec]:
    return [
        # Single-turn: verifiers' null harness (a chat loop, no tools).
        verifiers_env(
            "vf_arithmetic",
            splits={"train": 20, "test": 20},
            split_configs={"test": {"offset": 100}},
            harness="null",
            train_split="train",
        ),
        # Multi-turn with tools: verifiers' bash harness (bash and edit, run in the rollout's runtime).
        verifiers_env("vf_files", splits={"train": 4}, harness="bash"),
    ]
