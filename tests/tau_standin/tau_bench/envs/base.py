"""The Env semantics of docs/tau-bench.md: tools mutate data, reward = data-hash and outputs check."""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable
from typing import Any

from tau_bench.envs.user import load_user
from tau_bench.types import (
    RESPOND_ACTION_NAME,
    Action,
    EnvInfo,
    EnvResetResponse,
    EnvResponse,
    RewardActionInfo,
    RewardOutputInfo,
    RewardResult,
    Task,
)

Tool = Callable[..., str]


class Env:
    def __init__(
        self,
        data_load_func: Callable[[], dict[str, Any]],
        tools: dict[str, Tool],
        tools_info: list[dict[str, Any]],
        tasks: list[Task],
        wiki: str,
        user_strategy: str,
        user_model: str,
        user_provider: str | None = None,
        task_index: int | None = None,
    ) -> None:
        self.data_load_func = data_load_func
        self.data = data_load_func()
        self.tools_map = tools
        self.tools_info = tools_info
        self.terminate_tools = ["transfer_to_human_agents"]
        self.tasks = tasks
        # The same off-by-one as the real package, so callers must pass task_index.
        self.task_index = task_index if task_index is not None else random.randint(0, len(tasks))
        self.task = tasks[self.task_index]
        self.wiki = wiki
        self.user = load_user(user_strategy, user_model, user_provider)
        self.actions: list[Action] = []
        self.reward_computations = 0

    def reset(self, task_index: int | None = None) -> EnvResetResponse:
        if task_index is None:
            task_index = random.randint(0, len(self.tasks))
        self.task_index = task_index
        self.data = self.data_load_func()
        self.task = self.tasks[task_index]
        self.actions = []
        observation = self.user.reset(instruction=self.task.instruction)
        return EnvResetResponse(observation=observation, info=EnvInfo(task=self.task, source="user"))

    def step(self, action: Action) -> EnvResponse:
        self.actions.append(action)
        info = EnvInfo(task=self.task)
        reward = 0.0
        done = False
        if action.name == RESPOND_ACTION_NAME:
            observation = self.user.step(action.kwargs["content"])
            info.source = "user"
            done = "###STOP###" in observation
        elif action.name in self.tools_map:
            try:
                observation = self.tools_map[action.name](self.data, **action.kwargs)
            except Exception as exc:
                observation = f"Error: {exc}"
            info.source = action.name
            done = action.name in self.terminate_tools
        else:
            observation = f"Unknown action {action.name}"
            info.source = action.name
        if done:
            result = self.calculate_reward()
            reward = result.reward
            info.reward_info = result
            info.user_cost = self.user.get_total_cost()
        return EnvResponse(observation=observation, reward=reward, done=done, info=info)

    def data_hash(self) -> str:
        return hashlib.sha256(json.dumps(self.data, sort_keys=True).encode()).hexdigest()

    def calculate_reward(self) -> RewardResult:
        self.reward_computations += 1
        data_hash = self.data_hash()
        reward = 1.0
        self.data = self.data_load_func()
        for action in self.task.actions:
            if action.name not in self.terminate_tools:
                self.step(action)
        gt_data_hash = self.data_hash()
        info: RewardOutputInfo | RewardActionInfo = RewardActionInfo(
            r_actions=data_hash == gt_data_hash, gt_data_hash=gt_data_hash
        )
        if not info.r_actions:
            reward = 0.0
        if self.task.outputs:
            outputs = {
                output: any(
                    a.name == RESPOND_ACTION_NAME
                    and output.lower() in a.kwargs["content"].lower().replace(",", "")
                    for a in self.actions
                )
                for output in self.task.outputs
            }
            if not all(outputs.values()):
                reward = 0.0
            info = RewardOutputInfo(r_outputs=float(all(outputs.values())), outputs=outputs)
        actions = [a for a in self.task.actions if a.name != RESPOND_ACTION_NAME]
        return RewardResult(reward=reward, info=info, actions=actions)
