"""Agent-driven envs for tests/test_driven.py (ENV_PLUGINS `tests.support.driven_envs:env_specs`):
drivers that call the model through the episode's own endpoint as verifiers' rollouts do, in a few
lines, so that the hand-over and the finish are tested without verifiers installed."""

from __future__ import annotations

import functools
import os
import time
from typing import Any

import httpx

from service.envs.api import DriveOutcome, DriveRequest, EnvSpec

CALL_TIMEOUT_SECONDS = 60.0
# `driven/held` holds while the file this names exists (unset: it does not hold).
HOLD_FILE_VARIABLE = "DRIVEN_HOLD_FILE"
HOLD_POLL_SECONDS = 0.05


def chat(request: DriveRequest, content: str) -> str:
    """One chat completion through the episode's endpoint: the answer's text."""
    return complete(request, [{"role": "user", "content": content}])


def complete(request: DriveRequest, messages: list[dict[str, Any]]) -> str:
    """One chat completion of the conversation `messages`: the answer's text."""
    answer = httpx.post(
        f"{request.base_url}/chat/completions",
        json={"model": "policy", "messages": messages},
        headers={"Authorization": f"Bearer {request.api_key}"},
        timeout=CALL_TIMEOUT_SECONDS,
    )
    answer.raise_for_status()
    return str(answer.json()["choices"][0]["message"]["content"])


def ask(request: DriveRequest) -> DriveOutcome:
    """Asks once; reward 1 with the answer in info."""
    return DriveOutcome(1.0, {"answer": chat(request, f"Task {request.task_index}: say hello.")})


def not_json(request: DriveRequest) -> DriveOutcome:
    """Asks once, then ends with an info the service cannot store (NaN)."""
    chat(request, "Say hello.")
    return DriveOutcome(1.0, {"score": float("nan")})


def held(request: DriveRequest) -> DriveOutcome:
    """Asks once; starts over with another conversation (a second segment); holds while the file
    named by DRIVEN_HOLD_FILE exists; then continues that conversation: three calls, two segments."""
    first = chat(request, f"Task {request.task_index}: say hello.")
    again: list[dict[str, Any]] = [{"role": "user", "content": "Start over: say hello again."}]
    again.append({"role": "assistant", "content": complete(request, again)})
    hold = os.environ.get(HOLD_FILE_VARIABLE)
    while hold and os.path.exists(hold):
        time.sleep(HOLD_POLL_SECONDS)
    again.append({"role": "user", "content": "Once more."})
    return DriveOutcome(1.0, {"answers": [first, again[1]["content"], complete(request, again)]})


def never_built(split: str, user_sim: object) -> None:
    raise RuntimeError("agent-driven: no reset/step")


def env_specs() -> list[EnvSpec]:
    return [
        EnvSpec(
            name,
            {"train": 4},
            "An agent-driven env of the tests.",
            functools.partial(never_built),  # type: ignore[arg-type]
            train_split="train",
            driver=driver,
        )
        for name, driver in (("driven/ask", ask), ("driven/not-json", not_json), ("driven/held", held))
    ]
