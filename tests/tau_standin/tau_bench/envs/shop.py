"""A tiny order desk standing in for retail and airline: two orders, three tools."""

from __future__ import annotations

import copy
import json
from typing import Any

from tau_bench.envs.base import Env
from tau_bench.types import Action, Task

DATA: dict[str, Any] = {
    "orders": {
        "#W1": {"user_id": "ada_1", "status": "pending", "total": 1250.5, "items": ["lamp"]},
        "#W2": {"user_id": "bob_2", "status": "delivered", "total": 20.0, "items": ["mug"]},
    }
}

WIKI = (
    "# Order desk policy\nYou help users with their orders. Cancel only pending orders, after confirmation."
)


def load_data() -> dict[str, Any]:
    return copy.deepcopy(DATA)


def get_order_details(data: dict[str, Any], order_id: str) -> str:
    if order_id not in data["orders"]:
        raise KeyError(f"order {order_id} not found")
    return json.dumps(data["orders"][order_id])


def cancel_pending_order(data: dict[str, Any], order_id: str, reason: str) -> str:
    order = data["orders"].get(order_id)
    if order is None:
        raise KeyError(f"order {order_id} not found")
    if order["status"] != "pending":
        raise ValueError("non-pending order cannot be cancelled")
    order["status"] = "cancelled"
    order["cancel_reason"] = reason
    return json.dumps(order)


def transfer_to_human_agents(data: dict[str, Any], summary: str) -> str:
    return "Transfer successful"


TOOLS = {
    "get_order_details": get_order_details,
    "cancel_pending_order": cancel_pending_order,
    "transfer_to_human_agents": transfer_to_human_agents,
}


def _schema(name: str, description: str, **params: str) -> dict[str, Any]:
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


TOOLS_INFO = [
    _schema(
        "get_order_details", "Get the status and details of an order.", order_id="The order id, e.g. #W1."
    ),
    _schema(
        "cancel_pending_order",
        "Cancel a pending order.",
        order_id="The order id.",
        reason="'no longer needed' or 'ordered by mistake'.",
    ),
    _schema("transfer_to_human_agents", "Transfer the user to a human agent.", summary="The issue."),
]

CANCEL_W1 = Task(
    user_id="ada_1",
    instruction="You are Ada. Cancel order #W1 because you no longer need it, and ask for its total.",
    actions=[
        Action(name="get_order_details", kwargs={"order_id": "#W1"}),
        Action(name="cancel_pending_order", kwargs={"order_id": "#W1", "reason": "no longer needed"}),
    ],
    outputs=["1250.5"],
)
ASK_W2 = Task(
    user_id="bob_2",
    instruction="You are Bob. Ask whether order #W2 was delivered.",
    actions=[Action(name="get_order_details", kwargs={"order_id": "#W2"})],
    outputs=[],
)
TASKS = {
    "retail": {"test": [CANCEL_W1, ASK_W2], "train": [ASK_W2, CANCEL_W1, ASK_W2], "dev": [CANCEL_W1]},
    "airline": {"test": [ASK_W2]},
}


class ShopEnv(Env):
    def __init__(
        self,
        env_name: str,
        user_strategy: str,
        user_model: str,
        task_split: str,
        user_provider: str | None,
        task_index: int | None,
    ) -> None:
        splits = TASKS[env_name]
        if task_split not in splits:
            raise ValueError(f"Unknown task split: {task_split}")
        super().__init__(
            data_load_func=load_data,
            tools=TOOLS,
            tools_info=TOOLS_INFO,
            tasks=splits[task_split],
            wiki=WIKI,
            user_strategy=user_strategy,
            user_model=user_model,
            user_provider=user_provider,
            task_index=task_index,
        )
