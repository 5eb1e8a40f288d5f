"""verifiers environments (PyPI `verifiers` 0.4, its `verifiers.v1` stack) as envs of the service.

A verifiers environment is a taskset (tasks, with their `@vf.reward` rubric) played by an agent: a
harness (the program that talks to the model: `null`, a plain chat loop; `bash`, with bash and
edit tools; Claude Code, Codex, ...) in a runtime. It owns its rollout loop and calls the model
through its own OpenAI client, so the service hands each episode to `play` (an agent-driven env:
EnvSpec.driver), which runs verifiers' own agent on the task with its client pointed at the
episode's own OpenAI endpoint (`/v1/episodes/{id}`): every model call is recorded there with exact
tokens, resumed across weight updates, and bounded by the episode's `max_turns` and limits. The
rubric's reward (the sum of its weighted rewards) is the episode's reward; each reward, metric and
the trace's stop condition are in `info.verifiers`. A rollout that failed (the rubric did not run,
a call was refused) ends `aborted` with its errors, never with a reward of 0.

A package (or an ENV_PLUGINS loader) lists its tasksets with `verifiers_env`, splits and their
sizes given, since a taskset is only counted by loading it:

    def env_specs():
        return [verifiers_env("gsm8k-v1", splits={"train": 7473, "test": 1319},
                              split_configs={"test": {"split": "test"}}, train_split="train")]

Nothing of verifiers is imported to list them (importing it takes seconds); each env worker loads
a taskset at its first episode and keeps it.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import os
import threading
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from service.envs.base import DriveOutcome, DriveRequest, EnvSpec, UserSimConfig

PREFIX = "verifiers/"
# The model name the harness sends; the episode's endpoint serves the policy whatever it is named.
MODEL = "policy"


@dataclass(frozen=True)
class VerifiersEnv:
    """What an env worker needs to play a taskset's tasks: picklable, imports nothing."""

    taskset_id: str  # verifiers' id: the module exporting the Taskset (`gsm8k-v1`, `my_pkg.tasks`)
    harness: str | None = "null"  # the harness id; None: the taskset's default (verifiers': bash)
    # Per split, the taskset config's fields (`{"split": "test"}`); a split not named uses defaults.
    split_configs: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    runtime: Mapping[str, Any] = field(default_factory=lambda: {"type": "subprocess"})


def verifiers_env(
    taskset_id: str,
    *,
    splits: Mapping[str, int],
    name: str | None = None,
    description: str = "",
    split_configs: Mapping[str, Mapping[str, Any]] | None = None,
    harness: str | None = "null",
    runtime: Mapping[str, Any] | None = None,
    train_split: str | None = None,
) -> EnvSpec:
    """The EnvSpec of a verifiers taskset, named `verifiers/<taskset_id>` unless `name` says; task i
    of a split is the i-th task its taskset yields under that split's config."""
    env = VerifiersEnv(
        taskset_id,
        harness,
        dict(split_configs or {}),
        dict(runtime) if runtime is not None else {"type": "subprocess"},
    )
    return EnvSpec(
        name=name or f"{PREFIX}{taskset_id}",
        splits=dict(splits),
        description=description
        or f"verifiers taskset {taskset_id!r}, played by its {harness or 'default'} "
        "harness through the episode's own OpenAI endpoint; its rubric gives the reward.",
        factory=functools.partial(not_stepped, taskset_id),
        train_split=train_split,
        driver=functools.partial(play, env),
    )


def not_stepped(taskset_id: str, split: str, user_sim: UserSimConfig) -> Any:
    raise RuntimeError(f"verifiers taskset {taskset_id!r} is agent-driven: it has no reset/step")


# ---- In the env worker. ----

_TASKS: dict[tuple[str, str], Any] = {}  # (taskset id, split) -> its Tasks read so far, and the rest
_TASKS_LOCK = threading.Lock()


class _Tasks:
    """A taskset's tasks under one split's config, read from its `load()` as far as asked."""

    def __init__(self, env: VerifiersEnv, split: str) -> None:
        import verifiers.v1 as vf

        overrides = dict(env.split_configs.get(split, {}))
        config = vf.taskset_config_type(env.taskset_id).model_validate({**overrides, "id": env.taskset_id})
        self._rest = iter(vf.load_taskset(config))
        self._read: list[Any] = []
        self._lock = threading.Lock()

    def get(self, index: int) -> Any:
        with self._lock:
            if index >= len(self._read):
                self._read.extend(itertools.islice(self._rest, index + 1 - len(self._read)))
            if index >= len(self._read):
                raise IndexError(f"task {index} out of range: the taskset has {len(self._read)} tasks")
            return self._read[index]


def task_of(env: VerifiersEnv, split: str, index: int) -> Any:
    with _TASKS_LOCK:
        tasks = _TASKS.get((env.taskset_id, split))
        if tasks is None:
            tasks = _TASKS[(env.taskset_id, split)] = _Tasks(env, split)
    return tasks.get(index)


_LOOP: asyncio.AbstractEventLoop | None = None
_LOOP_LOCK = threading.Lock()


def rollout_loop() -> asyncio.AbstractEventLoop:
    """The env worker's one event loop for verifiers' rollouts, on a thread of its own: verifiers
    keeps per-process state (its runtimes' script environments, locks) that one loop must own."""
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="verifiers rollouts", daemon=True).start()
            _LOOP = loop
        return _LOOP


def play(env: VerifiersEnv, request: DriveRequest) -> DriveOutcome:
    """One episode: verifiers' agent on the task, its model the episode's endpoint (runs on the env
    worker's rollout loop; the calling env-call thread waits for it)."""
    task = task_of(env, request.task_split, request.task_index)
    return asyncio.run_coroutine_threadsafe(_rollout(env, task, request), rollout_loop()).result()


async def _rollout(env: VerifiersEnv, task: Any, request: DriveRequest) -> DriveOutcome:
    import verifiers.v1 as vf

    # verifiers reads an endpoint's key from an environment variable; a name of its own per episode.
    # Its runtimes leave variables whose name holds API_KEY out of the harness program's environment.
    key_var = f"ROLLOUT_API_KEY_{uuid.uuid4().hex}"
    os.environ[key_var] = request.api_key
    try:
        config = vf.AgentConfig.model_validate(
            {
                "model": MODEL,
                "harness": {"id": env.harness} if env.harness is not None else None,
                "runtime": dict(env.runtime),
                "client": {"type": "eval", "base_url": request.base_url, "api_key_var": key_var},
                "max_turns": request.max_turns,
            }
        )
        async with vf.make_agent(config) as agent:
            trace = await agent.run(task)
    finally:
        os.environ.pop(key_var, None)
    return outcome_of(trace)


def outcome_of(trace: Any) -> DriveOutcome:
    """The episode's ending from verifiers' Trace: its reward and components, or its errors."""
    rewards = {
        name: None if reward is None else {"score": reward.score, "weight": reward.weight}
        for name, reward in trace.rewards.items()
    }
    info = {
        "verifiers": {
            "trace_id": trace.id,
            "task_key": trace.task.key,
            "reward": trace.reward if trace.ok else None,
            "rewards": rewards,
            "metrics": dict(trace.metrics),
            "stop_condition": trace.stop_condition,
            "model_calls": len(trace.calls),
        }
    }
    if not trace.ok or any(reward is None for reward in trace.rewards.values()):
        errors = "; ".join(f"{error.type}: {error.message}" for error in trace.errors) or "no reward"
        info["verifiers"]["errors"] = [error.model_dump(exclude={"traceback"}) for error in trace.errors]
        return DriveOutcome(None, info, error=f"verifiers rollout failed ({trace.stop_condition}): {errors}")
    return DriveOutcome(float(trace.reward), info)
