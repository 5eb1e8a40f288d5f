"""The counter env of examples/openenv_counter/server.py as a local env: bench/remote_envs.py's
baseline. A module of its own, importable by name, so that an env worker process can unpickle its
factory whatever name the bench was loaded under (the smoke test loads it as `bench_remote_envs`)."""

from __future__ import annotations

from typing import Any

from service.envs.base import Action, Reset, Step, UserSimConfig


class LocalCounter:
    system_prompt = "Use the tools."
    tools: list[dict[str, Any]] = []

    def __init__(self, split: str, user_sim: UserSimConfig) -> None:
        self.counter = self.target = 0

    def reset(self, task_index: int) -> Reset:
        self.counter, self.target = 0, task_index + 2
        return Reset(observation=f"Reach {self.target} with add, then submit it.")

    def step(self, action: Action) -> Step:
        if action.name == "add":
            self.counter += int(action.kwargs["n"])
            return Step(observation=str(self.counter), reward=0.0, done=False)
        right = str(action.kwargs["answer"]) == str(self.target)
        return Step(observation="right" if right else "wrong", reward=float(right), done=True)


def local_counter(split: str, user_sim: UserSimConfig) -> LocalCounter:
    return LocalCounter(split, user_sim)
