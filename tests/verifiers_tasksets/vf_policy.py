"""The simulated worker's policy for tests/verifiers_tasksets' tasksets (`sim-worker --policy
vf_policy:policy`; SimConfig(policy=...) in tests/test_verifiers_envs.py)."""

from __future__ import annotations

import re

from service.sim.policy import SimConfig, parse_chatml, policy_reply


def policy(prompt: str, key: str) -> str:
    """Plays both tasksets: sums right when the first term is even and off by one otherwise; writes
    the asked word to answer.txt with the bash tool, then says done. Anything else as the simulated
    worker's own policy plays it."""
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
    return policy_reply(prompt, key, SimConfig())[0]  # builtin/shop's oracle, and the generic policy
