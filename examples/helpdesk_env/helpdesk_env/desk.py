"""The help desk environment: a seeded database of employees, tools that read and change it, tasks
with ground-truth actions, a scripted user, and a reward on the final state.

Everything here runs inside the service's env worker processes: `make_env` is sent there by
reference (a module-level function pickles), builds one `HelpDeskEnv` per episode, and the env's
`reset`/`step` run there, one call at a time.
"""

from __future__ import annotations

import copy
import json
import random
from dataclasses import dataclass
from functools import cache
from typing import Any

from service.envs.api import RESPOND_ACTION_NAME, Action, Reset, Step, UserSimConfig, function_tool

SEED = 7
SPLIT_SIZES = {"train": 120, "test": 30}
CATEGORIES = ["hardware", "software", "access"]
NAMES = ["Ada", "Bo", "Cyd", "Dev", "Eun", "Fay", "Gus", "Hal", "Ines", "Jo", "Kai", "Lu"]
CONFIRM = "Yes, please do."
GOODBYE = "Great, thanks! That's all."

SYSTEM_PROMPT = """You are the IT help desk. Identify the employee by email first (lookup_employee), \
then do what they ask: unlock a locked account, reset a password, or open a ticket for a broken \
device (category hardware). Make one tool call at a time. When done, tell the user in one sentence."""

TOOLS = [
    function_tool(
        "lookup_employee",
        "Find an employee by email: id, name, whether the account is locked.",
        {"email": {"type": "string", "description": "The employee's email."}},
    ),
    function_tool("unlock_account", "Unlock an employee's account.", {"employee_id": {"type": "string"}}),
    function_tool(
        "reset_password",
        "Send an employee a password reset link.",
        {"employee_id": {"type": "string"}},
    ),
    function_tool(
        "open_ticket",
        "Open a ticket for an employee.",
        {
            "employee_id": {"type": "string"},
            "category": {"type": "string", "enum": CATEGORIES},
            "summary": {"type": "string", "description": "One line."},
        },
    ),
]


@cache
def initial_state() -> dict[str, Any]:
    rng = random.Random(SEED)
    employees = {}
    for number, name in enumerate(NAMES):
        employee_id = f"E{100 + number}"
        employees[employee_id] = {
            "name": name,
            "email": f"{name.lower()}@corp.example",
            "locked": rng.random() < 0.5,
            "password_resets": 0,
        }
    return {"employees": employees, "tickets": []}


@dataclass(frozen=True)
class Task:
    request: str  # the user's first message
    actions: tuple[Action, ...]  # ground truth: the state changes a perfect agent makes


@cache
def tasks(split: str) -> tuple[Task, ...]:
    state = initial_state()
    rng = random.Random(f"{SEED}:{split}")
    made = []
    for _ in range(SPLIT_SIZES[split]):
        employee_id = rng.choice(sorted(state["employees"]))
        employee = state["employees"][employee_id]
        hello = f"Hi, I'm {employee['name']} ({employee['email']})."
        kind = rng.choice(["unlock", "reset", "ticket"] if employee["locked"] else ["reset", "ticket"])
        who = {"employee_id": employee_id}
        if kind == "unlock":
            made.append(Task(f"{hello} I'm locked out of my account.", (Action("unlock_account", who),)))
        elif kind == "reset":
            made.append(Task(f"{hello} I forgot my password.", (Action("reset_password", who),)))
        else:
            device = rng.choice(["laptop screen", "keyboard", "headset"])
            ticket = {**who, "category": "hardware", "summary": f"broken {device}"}
            made.append(Task(f"{hello} My {device} is broken.", (Action("open_ticket", ticket),)))
    return tuple(made)


class ToolError(Exception):
    pass


def run_tool(state: dict[str, Any], action: Action) -> str:
    """A tool's answer as the model sees it; a refused or malformed call answers 'Error: ...'."""
    try:
        return json.dumps(_tool(state, action.name, dict(action.kwargs)))
    except ToolError as error:
        return f"Error: {error}"
    except (KeyError, TypeError) as error:
        return f"Error: bad arguments for {action.name}: {error!r}"


def _employee(state: dict[str, Any], employee_id: Any) -> dict[str, Any]:
    if employee_id not in state["employees"]:
        raise ToolError(f"no employee {employee_id!r}")
    employee: dict[str, Any] = state["employees"][employee_id]
    return employee


def _tool(state: dict[str, Any], name: str, kwargs: dict[str, Any]) -> Any:
    if name == "lookup_employee":
        for employee_id, employee in state["employees"].items():
            if employee["email"] == str(kwargs["email"]).strip().lower():
                return {"employee_id": employee_id, "name": employee["name"], "locked": employee["locked"]}
        raise ToolError(f"no employee with email {kwargs['email']!r}")
    if name == "unlock_account":
        employee = _employee(state, kwargs["employee_id"])
        if not employee["locked"]:
            raise ToolError("the account is not locked")
        employee["locked"] = False
        return {"unlocked": kwargs["employee_id"]}
    if name == "reset_password":
        _employee(state, kwargs["employee_id"])["password_resets"] += 1
        return {"reset_link_sent": kwargs["employee_id"]}
    if name == "open_ticket":
        _employee(state, kwargs["employee_id"])
        if kwargs["category"] not in CATEGORIES:
            raise ToolError(f"category must be one of {CATEGORIES}")
        state["tickets"].append({"employee_id": kwargs["employee_id"], "category": kwargs["category"]})
        return {"ticket": len(state["tickets"])}
    raise ToolError(f"unknown tool {name!r}")


class HelpDeskEnv:
    """One episode. The scripted user confirms a question and otherwise ends the conversation."""

    system_prompt = SYSTEM_PROMPT
    tools = TOOLS

    def __init__(self, split: str) -> None:
        self.split = split
        self.task: Task | None = None
        self.state: dict[str, Any] = {}

    def reset(self, task_index: int) -> Reset:
        split_tasks = tasks(self.split)
        if not 0 <= task_index < len(split_tasks):
            raise IndexError(f"task_index {task_index} out of range 0..{len(split_tasks) - 1}")
        self.task = split_tasks[task_index]
        self.state = copy.deepcopy(initial_state())
        # info is for the trainer's records (the ground truth), never shown to the policy.
        actions = [{"name": action.name, "kwargs": dict(action.kwargs)} for action in self.task.actions]
        return Reset(self.task.request, {"task_index": task_index, "ground_truth": actions})

    def step(self, action: Action) -> Step:
        if self.task is None:
            raise RuntimeError("step before reset")
        if action.name != RESPOND_ACTION_NAME:
            return Step(run_tool(self.state, action), reward=0.0, done=False)
        if str(action.kwargs.get("content", "")).rstrip().endswith("?"):
            return Step(CONFIRM, reward=0.0, done=False)
        return self._end()

    def _end(self) -> Step:
        assert self.task is not None
        expected = copy.deepcopy(initial_state())
        for action in self.task.actions:
            run_tool(expected, action)
        matched = _comparable(self.state) == _comparable(expected)
        reward = 1.0 if matched else 0.0
        return Step(GOODBYE, reward, done=True, info={"state_matches_ground_truth": matched})


def _comparable(state: dict[str, Any]) -> str:
    # A ticket's summary is free text: only who and which category count.
    return json.dumps(state, sort_keys=True)


def make_env(split: str, user_sim: UserSimConfig) -> HelpDeskEnv:
    tasks(split)  # an unknown split fails here, at construction
    return HelpDeskEnv(split)
