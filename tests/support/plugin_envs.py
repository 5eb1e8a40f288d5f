"""Env plugins for the plugin tests: loaders as ENV_PLUGINS names them (`module:function`), good and bad."""

from __future__ import annotations

import math
import time
from typing import Any

from service.envs.api import RESPOND_ACTION_NAME, Action, EnvSpec, Reset, Step, UserSimConfig, function_tool

COUNTER_TOOLS = [
    function_tool("add", "Add to the counter.", {"amount": {"type": "integer", "description": "How much."}}),
    function_tool("read", "Read the counter.", {}),
]


class CounterEnv:
    """Task i: bring the counter to i + 1 with `add`, then answer; reward 1 when the final counter is
    right. `info` has the target (for the trainer); steps named `raise`, `nan`, `bad_info` misbehave."""

    system_prompt = "Bring the counter to the target the user names, then say done."
    tools = COUNTER_TOOLS

    def __init__(self, split: str) -> None:
        self.split = split
        self.target = 0
        self.counter = 0

    def reset(self, task_index: int) -> Reset:
        self.target, self.counter = task_index + 1, 0
        return Reset(f"Please bring the counter to {self.target}.", {"target": self.target})

    def step(self, action: Action) -> Step:
        if action.name == "add":
            self.counter += int(action.kwargs.get("amount", 0))
            return Step(str(self.counter), 0.0, False)
        if action.name == "read":
            return Step(str(self.counter), 0.0, False)
        if action.name == RESPOND_ACTION_NAME:
            reward = 1.0 if self.counter == self.target else 0.0
            return Step("Thanks.", reward, True, {"final_counter": self.counter})
        return Step(f"Error: unknown tool {action.name}", 0.0, False)


HANG_SECONDS = 3.0  # past the tests' ENV_CALL_TIMEOUT_SECONDS


class MisbehavingEnv(CounterEnv):
    """Its split names how it misbehaves: `reset` raises in reset, `step` in step, `late` in the step
    after one that rewarded 0, `hang` blocks past the call timeout, `nan` gives a
    NaN in info, `surrogate` a lone surrogate in its transcript, `object` a non-JSON info value."""

    def reset(self, task_index: int) -> Reset:
        if self.split == "reset":
            raise ValueError("reset exploded")
        return super().reset(task_index)

    def step(self, action: Action) -> Step:
        if self.split == "step":
            raise ValueError("step exploded")
        if self.split == "late" and self.counter:
            raise ValueError("step exploded after a reward")
        if self.split == "hang":
            time.sleep(HANG_SECONDS)
        if self.split == "nan":
            return Step("x", 0.0, False, {"score": math.nan})
        if self.split == "surrogate":
            return Step("x", 0.0, False, transcript=[{"role": "user", "content": "\ud800", "env_only": True}])
        if self.split == "object":
            return Step("x", 0.0, False, {"when": object()})
        return super().step(action)


def counter_env(split: str, user_sim: UserSimConfig) -> CounterEnv:
    return CounterEnv(split)


def misbehaving_env(split: str, user_sim: UserSimConfig) -> MisbehavingEnv:
    return MisbehavingEnv(split)


def env_specs() -> list[EnvSpec]:
    return [
        EnvSpec("plugin/counter", {"train": 20, "test": 5}, "A counter to bring to a target.", counter_env),
        EnvSpec(
            "plugin/misbehaving",
            dict.fromkeys(("reset", "step", "late", "nan", "surrogate", "object", "hang"), 2),
            "Misbehaves as its split says.",
            misbehaving_env,
        ),
    ]


def invalid_specs() -> list[Any]:
    return [
        EnvSpec("plugin/lambda", {"train": 1}, "Its factory does not pickle.", lambda split, sim: None),  # type: ignore[arg-type, return-value]
        EnvSpec(
            "plugin/wrong-train",
            {"test": 1},
            "Its train split is not a split.",
            counter_env,
            train_split="train",
        ),
        EnvSpec("plugin/future", {"test": 1}, "A protocol from the future.", counter_env, protocol=2),
        EnvSpec("builtin/shop", {"test": 1}, "Takes a builtin's name.", counter_env),
        "not a spec",
    ]


def raising() -> list[EnvSpec]:
    raise RuntimeError("the plugin's loader failed")


NOT_A_FUNCTION = 42
