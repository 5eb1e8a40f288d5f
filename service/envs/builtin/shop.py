"""`builtin/shop`: a small tau-bench-like retail domain that ships with the service.

Users, orders and products in a small database generated from a fixed seed; tools that read and
change it; tasks with ground-truth actions; a scripted user; reward 1.0 when the final database
equals the one the ground-truth actions produce (tau-bench's rule).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

from service.envs.base import RESPOND_ACTION_NAME, Action, Reset, Step, UserSimConfig

DATA_SEED = 20261122
NUM_USERS = 60
SPLIT_SIZES = {"train": 200, "test": 50}
STOP_TOKEN = "###STOP###"
CONFIRM_REPLY = "Yes, please go ahead."
FINAL_REPLY = f"Thank you, that is all. {STOP_TOKEN}"

FIRST_NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana", "Ivo", "Jun", "Kofi", "Lena"]
LAST_NAMES = ["Silva", "Okafor", "Novak", "Kim", "Larsen", "Moreau", "Patel", "Rossi", "Sato", "Weber"]
STREETS = ["Oak St", "Elm Ave", "Maple Rd", "Harbor Way", "Hill Ct", "Lake Dr", "Pine Ln", "River Rd"]
CITIES = ["Austin", "Denver", "Lyon", "Porto", "Osaka", "Leeds", "Graz", "Tartu"]
PRODUCTS = {
    "P100": ("desk lamp", 34.0), "P101": ("water bottle", 18.5), "P102": ("backpack", 79.0),
    "P103": ("headphones", 129.0), "P104": ("notebook", 6.25), "P105": ("kettle", 45.0),
    "P106": ("yoga mat", 29.9), "P107": ("phone case", 15.0), "P108": ("coffee grinder", 99.0),
}  # fmt: skip
REASONS = ["no longer needed", "ordered by mistake"]

SYSTEM_PROMPT = """You are a customer service agent of an online shop. Help the user with their orders.
- First authenticate the user: find their user id from their email, even if they give their name.
- You can look up users and orders, cancel orders that are still pending (the reason must be \
"no longer needed" or "ordered by mistake"), and change the shipping address of pending orders.
- Before an action that changes the database, list what you will do and get the user's explicit \
confirmation (yes) to go on.
- Make at most one tool call at a time, and do not respond to the user in the same turn.
- Transfer the user to a human agent only if the request is outside this policy."""


def _tool(name: str, description: str, **params: str) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {key: {"type": "string", "description": text} for key, text in params.items()},
                "required": list(params),
            },
        },
    }


TOOLS = [
    _tool("find_user_id_by_email", "Find a user's id from their email.", email="The user's email."),
    _tool(
        "get_user_details", "Get a user's profile and order ids.", user_id="The user id, e.g. 'ana_silva_7'."
    ),
    _tool(
        "get_order_details",
        "Get an order's status, items and address.",
        order_id="The order id, e.g. '#W1003'.",
    ),
    _tool(
        "cancel_pending_order",
        "Cancel a pending order.",
        order_id="The order id.",
        reason="'no longer needed' or 'ordered by mistake'.",
    ),
    _tool(
        "modify_pending_order_address",
        "Change the shipping address of a pending order.",
        order_id="The order id.",
        address="The full new address.",
    ),
    _tool(
        "transfer_to_human_agents", "Transfer the user to a human agent.", summary="A summary of the issue."
    ),
]


class ToolError(Exception):
    """A tool refused the call; the agent sees 'Error: <message>'."""


def _generate_database() -> dict[str, Any]:
    rng = random.Random(DATA_SEED)
    users: dict[str, Any] = {}
    orders: dict[str, Any] = {}
    for number in range(NUM_USERS):
        first, last = rng.choice(FIRST_NAMES), rng.choice(LAST_NAMES)
        user_id = f"{first.lower()}_{last.lower()}_{number}"
        address = f"{rng.randint(1, 999)} {rng.choice(STREETS)}, {rng.choice(CITIES)}"
        email = f"{first}.{last}{number}@example.com".lower()
        user: dict[str, Any] = {"name": f"{first} {last}", "email": email, "address": address, "orders": []}
        for _ in range(rng.randint(1, 3)):
            order_id = f"#W{1000 + len(orders)}"
            items = sorted(rng.sample(sorted(PRODUCTS), rng.randint(1, 3)))
            status = rng.choice(["pending", "pending", "delivered"])
            orders[order_id] = {"user_id": user_id, "status": status, "items": items, "address": address}
            user["orders"].append(order_id)
        users[user_id] = user
    return {"users": users, "orders": orders}


@cache
def _initial_database() -> dict[str, Any]:
    return _generate_database()


def fresh_database() -> dict[str, Any]:
    """A private copy of the initial database for one episode.

    Copy-on-write: tools never change a user or an order in place, they replace the order's entry
    (see _cancel, _modify_address), so copying the orders map is enough and costs microseconds.
    """
    initial = _initial_database()
    return {"users": initial["users"], "orders": dict(initial["orders"])}


@dataclass(frozen=True)
class Task:
    user_id: str
    instruction: str  # the user's first message
    actions: tuple[Action, ...]  # ground truth: the database changes a perfect agent makes
    confirm_before: int  # index in `actions` of the first write (confirmation needed before it)


def _generate_tasks(split: str) -> list[Task]:
    database = _initial_database()
    rng = random.Random(f"{DATA_SEED}:{split}")
    tasks = []
    pending = sorted(oid for oid, order in database["orders"].items() if order["status"] == "pending")
    for _ in range(SPLIT_SIZES[split]):
        order_id = rng.choice(pending)
        order = database["orders"][order_id]
        user = database["users"][order["user_id"]]
        lookups = (
            Action("find_user_id_by_email", {"email": user["email"]}),
            Action("get_order_details", {"order_id": order_id}),
        )
        if rng.random() < 0.5:
            reason = rng.choice(REASONS)
            write = Action("cancel_pending_order", {"order_id": order_id, "reason": reason})
            request = f"Please cancel my order {order_id}, it was {reason}."
        else:
            address = f"{rng.randint(1, 999)} {rng.choice(STREETS)}, {rng.choice(CITIES)}"
            write = Action("modify_pending_order_address", {"order_id": order_id, "address": address})
            request = f"Please ship my order {order_id} to {address} instead."
        instruction = f"Hi, I am {user['name']}, my email is {user['email']}. {request}"
        tasks.append(Task(order["user_id"], instruction, (*lookups, write), confirm_before=len(lookups)))
    return tasks


@cache
def tasks(split: str) -> tuple[Task, ...]:
    if split not in SPLIT_SIZES:
        raise KeyError(f"unknown split {split!r}; known: {sorted(SPLIT_SIZES)}")
    return tuple(_generate_tasks(split))


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def _pending_order(database: dict[str, Any], order_id: str) -> dict[str, Any]:
    order = database["orders"].get(order_id)
    if order is None:
        raise ToolError(f"order {order_id} not found")
    if order["status"] != "pending":
        raise ToolError(f"order {order_id} is {order['status']}, not pending")
    return dict(order)


def _find_user(database: dict[str, Any], email: str) -> str:
    for user_id, user in database["users"].items():
        if user["email"] == email.strip().lower():
            return str(user_id)
    raise ToolError(f"no user with email {email}")


def _get_user(database: dict[str, Any], user_id: str) -> str:
    if user_id not in database["users"]:
        raise ToolError(f"user {user_id} not found")
    return _json(database["users"][user_id])


def _get_order(database: dict[str, Any], order_id: str) -> str:
    if order_id not in database["orders"]:
        raise ToolError(f"order {order_id} not found")
    order = database["orders"][order_id]
    items = [
        {"product_id": pid, "name": PRODUCTS[pid][0], "price": PRODUCTS[pid][1]} for pid in order["items"]
    ]
    return _json({**order, "order_id": order_id, "items": items})


def _cancel(database: dict[str, Any], order_id: str, reason: str) -> str:
    order = _pending_order(database, order_id)
    if reason not in REASONS:
        raise ToolError(f"reason must be one of {REASONS}")
    database["orders"][order_id] = {**order, "status": "cancelled", "cancel_reason": reason}
    return _json(database["orders"][order_id])


def _modify_address(database: dict[str, Any], order_id: str, address: str) -> str:
    order = _pending_order(database, order_id)
    database["orders"][order_id] = {**order, "address": address}
    return _json(database["orders"][order_id])


def _transfer(database: dict[str, Any], summary: str) -> str:
    return "Transfer successful"


TOOL_FUNCTIONS: dict[str, Callable[..., str]] = {
    "find_user_id_by_email": _find_user,
    "get_user_details": _get_user,
    "get_order_details": _get_order,
    "cancel_pending_order": _cancel,
    "modify_pending_order_address": _modify_address,
    "transfer_to_human_agents": _transfer,
}


def run_tool(database: dict[str, Any], action: Action) -> str:
    function = TOOL_FUNCTIONS.get(action.name)
    if function is None:
        return f"Unknown action {action.name}"
    try:
        return function(database, **action.kwargs)
    except ToolError as error:
        return f"Error: {error}"
    except TypeError as error:  # wrong or missing arguments, as the model may send them
        return f"Error: bad arguments for {action.name}: {error}"


def databases_match(database: dict[str, Any], expected: dict[str, Any]) -> bool:
    """Whether two episode databases are the same JSON, as tau-bench's reward compares them (by a
    hash of each whole database). Copy-on-write (fresh_database) leaves every user and order a tool
    did not replace the very object of the initial database: only the others are compared. Two
    whole hashes were about 1 ms an episode, most of builtin/shop's CPU."""
    if database.keys() != expected.keys():
        return False
    for name, table in database.items():
        other = expected[name]
        if table is other:
            continue
        if table.keys() != other.keys():
            return False
        if any(row is not other[key] and _json(row) != _json(other[key]) for key, row in table.items()):
            return False
    return True


class ShopEnv:
    """One episode of `builtin/shop`. The user is scripted: it confirms a question, ends otherwise."""

    system_prompt = SYSTEM_PROMPT
    tools = TOOLS

    def __init__(self, split: str) -> None:
        self.split = split
        self.task: Task | None = None
        self.database: dict[str, Any] = {}

    def reset(self, task_index: int) -> Reset:
        split_tasks = tasks(self.split)
        if not 0 <= task_index < len(split_tasks):
            raise IndexError(f"task_index {task_index} out of range 0..{len(split_tasks) - 1}")
        self.task = split_tasks[task_index]
        self.database = fresh_database()
        return Reset(self.task.instruction, {"task": _task_info(self.task), "split": self.split})

    def step(self, action: Action) -> Step:
        if self.task is None:
            raise RuntimeError("step before reset")
        if action.name == "transfer_to_human_agents":
            run_tool(self.database, action)
            return self._end("Transfer successful")
        if action.name != RESPOND_ACTION_NAME:
            return Step(run_tool(self.database, action), 0.0, False, {})
        content = str(action.kwargs.get("content", ""))
        if content.rstrip().endswith("?"):
            return Step(CONFIRM_REPLY, 0.0, False, {})
        return self._end(FINAL_REPLY)

    def _end(self, observation: str) -> Step:
        assert self.task is not None
        expected = fresh_database()
        for action in self.task.actions:
            run_tool(expected, action)
        matched = databases_match(self.database, expected)
        reward = 1.0 if matched else 0.0
        info = {"reward_info": {"reward": reward, "database_matches_ground_truth": matched}}
        return Step(observation, reward, True, info)


def _task_info(task: Task) -> dict[str, Any]:
    return {
        "user_id": task.user_id,
        "instruction": task.instruction,
        "actions": [{"name": action.name, "kwargs": action.kwargs} for action in task.actions],
    }


def make_shop_env(split: str, user_sim: UserSimConfig) -> ShopEnv:
    tasks(split)  # fail fast on an unknown split
    return ShopEnv(split)


def oracle_plan(task: Task) -> list[Action]:
    """What a perfect agent does: the ground-truth calls, asking for confirmation before writes."""
    plan = list(task.actions[: task.confirm_before])
    write_names = ", ".join(action.name for action in task.actions[task.confirm_before :])
    plan.append(Action(RESPOND_ACTION_NAME, {"content": f"I will now run: {write_names}. Shall I go ahead?"}))
    plan.extend(task.actions[task.confirm_before :])
    plan.append(Action(RESPOND_ACTION_NAME, {"content": "Done: your request has been completed."}))
    return plan


@cache
def task_by_instruction() -> dict[str, Task]:
    return {task.instruction: task for split in SPLIT_SIZES for task in tasks(split)}
