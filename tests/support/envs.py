"""Environments for the env-host tests: module-level factories, importable by spawned workers."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from service.envs.base import RESPOND_ACTION_NAME, Action, EnvSpec, Reset, Step, UserSimConfig

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "whoami",
            "description": "Which process and thread run this environment.",
            "parameters": {"type": "object", "properties": {}},
        },
    }
]


class ProbeEnv:
    """Answers where it runs; `boom` raises, `crash` kills its worker process, `sleep` blocks its
    thread like a user-simulator HTTP call, `respond` ends. Fails loudly if two calls overlap."""

    def __init__(self, split: str, user_sim: UserSimConfig) -> None:
        self.split = split
        self.user_sim = user_sim
        self.system_prompt = f"probe env, split {split}"
        self.tools = TOOLS
        self.pid = os.getpid()
        self.task_index = -1
        self.steps = 0
        self.tags: list[Any] = []
        self._in_call = threading.Lock()

    def reset(self, task_index: int) -> Reset:
        self.task_index = task_index
        return Reset(observation=f"task {task_index}", info={"pid": os.getpid(), "task_index": task_index})

    def step(self, action: Action) -> Step:
        if not self._in_call.acquire(blocking=False):
            raise RuntimeError("two calls of one env at once")
        try:
            return self._step(action)
        finally:
            self._in_call.release()

    def _step(self, action: Action) -> Step:
        self.steps += 1
        self.tags.append(action.kwargs.get("tag"))
        info = {
            "pid": os.getpid(),
            "thread": threading.get_ident(),
            "steps": self.steps,
            "tags": list(self.tags),
        }
        if action.name == "sleep":
            started = time.monotonic()
            time.sleep(float(action.kwargs["seconds"]))
            info |= {"started": started, "ended": time.monotonic()}
        if action.name == "boom":
            raise ValueError(f"boom at step {self.steps}")
        if action.name == "crash":
            os._exit(int(action.kwargs.get("code", 3)))
        if action.name == "unpicklable":
            return Step(observation="", reward=0.0, done=False, info={"lock": threading.Lock()})
        if action.name == RESPOND_ACTION_NAME:
            return Step(observation="bye", reward=1.0, done=True, info=info)
        return Step(
            observation=f"pid {os.getpid()} task {self.task_index}", reward=0.0, done=False, info=info
        )


def probe_env(split: str, user_sim: UserSimConfig) -> ProbeEnv:
    return ProbeEnv(split, user_sim)


def failing_env(split: str, user_sim: UserSimConfig) -> ProbeEnv:
    raise KeyError(f"cannot build split {split}")


SLOW_BUILD_SECONDS = 0.5


def slow_env(split: str, user_sim: UserSimConfig) -> ProbeEnv:
    time.sleep(SLOW_BUILD_SECONDS)
    return ProbeEnv(split, user_sim)


TEST_ENVS = {
    spec.name: spec
    for spec in (
        EnvSpec(
            "test/probe", {"train": 10, "test": 2}, "Reports its process; can raise or crash.", probe_env
        ),
        EnvSpec("test/failing", {"train": 1}, "Its factory raises.", failing_env),
        EnvSpec("test/slow", {"train": 1}, f"Takes {SLOW_BUILD_SECONDS} s to build.", slow_env),
    )
}
