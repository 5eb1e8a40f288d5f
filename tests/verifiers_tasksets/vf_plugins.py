"""The ENV_PLUGINS loader of tests/test_verifiers_envs.py (and bench/verifiers_envs.py): the two test
tasksets as service envs, and the simulated worker's policy that plays them (`--policy`)."""

from __future__ import annotations

import re

from service.envs.api import EnvSpec
from service.envs.verifiers_envs import verifiers_env
from service.sim.policy import parse_chatml


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


def policy(prompt: str, key: str) -> str:
    """Plays both tasksets: sums right when the first term is even and off by one otherwise; writes
    the asked word to answer.txt with the bash tool, then says done."""
    messages = parse_chatml(prompt)
    user = next(content for role, content, _ in messages if role == "user")
    if match := re.search(r"What is (\d+) \+ (\d+)\?", user):
        a, b = int(match[1]), int(match[2])
        return str(a + b if a % 2 == 0 else a + b + 1)
    if match := re.search(r"Write the word (\w+)", user):
        if not any(role == "assistant" for role, _, closed in messages if closed):
            command = f"printf {match[1]} > answer.txt"
            return f'<tool_call>\n{{"name": "bash", "arguments": {{"command": "{command}"}}}}\n</tool_call>'
        return "Done."
    return "I cannot tell."
