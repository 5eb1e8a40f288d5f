"""tau-bench (retail, airline) as Environments, with our own user simulator.

`tau_bench` is an optional install and imports litellm (~3 s): it is imported only here, lazily,
inside the env worker that builds an episode's environment.
"""

from __future__ import annotations

import atexit
import functools
import os
from typing import Any

import httpx

from service.envs.base import Action, Reset, Step, UserSimConfig
from service.envs.user_sim import USER_SIM_TIMEOUT_SECONDS, OpenAIUserSimulator

TAU_DOMAINS = ("retail", "airline")


@functools.cache
def _user_sim_client() -> httpx.Client:
    # One connection pool per env worker process, shared by its episodes (httpx.Client is thread-safe).
    # Closed at exit: else the interpreter frees its kept-alive socket unclosed (a ResourceWarning).
    client = httpx.Client(timeout=USER_SIM_TIMEOUT_SECONDS)
    atexit.register(client.close)
    return client


def _import_get_env() -> Any:
    # Else litellm fetches its model price map from the network at import.
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    try:
        from tau_bench.envs import get_env
    except ImportError as exc:
        raise ImportError(
            "tau-bench environments need the tau_bench package (not on PyPI): pip install "
            '".[tau]" "tau_bench @ git+https://github.com/sierra-research/tau-bench"'
        ) from exc
    return get_env


class TauBenchEnvironment:
    """One tau-bench episode. `info` of reset/step is tau-bench's EnvInfo as a dict: the task with
    its ground-truth actions and outputs, and at done the reward details (for the trainer only)."""

    def __init__(
        self,
        domain: str,
        split: str,
        user_sim: UserSimConfig,
        client: httpx.Client | None = None,
    ) -> None:
        if domain not in TAU_DOMAINS:
            raise ValueError(f"unknown tau-bench domain {domain!r}; known: {TAU_DOMAINS}")
        get_env = _import_get_env()
        # A "human" user is built without side effects (an "llm" one makes a wasted LLM call), and
        # is replaced right away. task_index=0: the random pick when it is None can be out of range.
        self._env = get_env(
            domain,
            user_strategy="human",
            user_model=user_sim.model or "user-simulator",
            task_split=split,
            task_index=0,
        )
        self._env.user = OpenAIUserSimulator(user_sim, client if client is not None else _user_sim_client())
        self.domain = domain
        self.split = split
        self.system_prompt: str = self._env.wiki
        self.tools: list[dict[str, Any]] = list(self._env.tools_info)
        self._done = False

    @property
    def num_tasks(self) -> int:
        return len(self._env.tasks)

    def reset(self, task_index: int) -> Reset:
        if not 0 <= task_index < self.num_tasks:
            raise IndexError(
                f"task_index {task_index} out of range: tau-bench {self.domain}/{self.split} "
                f"has {self.num_tasks} tasks"
            )
        self._done = False
        response = self._env.reset(task_index=task_index)
        return Reset(observation=response.observation, info=response.info.model_dump())

    def step(self, action: Action) -> Step:
        if self._done:
            # tau-bench would compute the reward again, on data its first computation mutated.
            raise RuntimeError("the episode is over: step() after done")
        from tau_bench.types import Action as TauAction

        response = self._env.step(TauAction(name=action.name, kwargs=action.kwargs))
        self._done = bool(response.done)
        return Step(
            observation=response.observation,
            reward=float(response.reward),
            done=self._done,
            info=response.info.model_dump(),
        )


def retail_env(split: str, user_sim: UserSimConfig) -> TauBenchEnvironment:
    return TauBenchEnvironment("retail", split, user_sim)


def airline_env(split: str, user_sim: UserSimConfig) -> TauBenchEnvironment:
    return TauBenchEnvironment("airline", split, user_sim)
