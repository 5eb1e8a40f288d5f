"""The built-in shop environment: its oracle earns 1.0, mistakes 0.0, and episodes never share state."""

from __future__ import annotations

import json

import pytest

from service.envs.base import RESPOND_ACTION_NAME, Action, UserSimConfig
from service.envs.builtin.shop import (
    SPLIT_SIZES,
    _initial_database,
    databases_match,
    fresh_database,
    make_shop_env,
    oracle_plan,
    tasks,
)


@pytest.mark.parametrize("split", sorted(SPLIT_SIZES))
def test_the_oracle_earns_full_reward_on_every_task(split: str) -> None:
    for index in range(SPLIT_SIZES[split]):
        env = make_shop_env(split, UserSimConfig())
        env.reset(index)
        steps = [env.step(action) for action in oracle_plan(tasks(split)[index])]
        assert [step.done for step in steps] == [False] * (len(steps) - 1) + [True]
        assert steps[-1].reward == 1.0


def test_a_skipped_write_earns_nothing_and_leaves_the_initial_database_alone() -> None:
    before = json.dumps(_initial_database(), sort_keys=True)
    first, second = make_shop_env("test", UserSimConfig()), make_shop_env("test", UserSimConfig())
    first.reset(0)
    second.reset(0)
    for action in oracle_plan(tasks("test")[0])[:-1]:
        first.step(action)  # the first episode changes its database...
    assert second.database == _initial_database()  # ...not the second's
    assert first.step(Action(RESPOND_ACTION_NAME, {"content": "Done."})).reward == 1.0
    assert second.step(Action(RESPOND_ACTION_NAME, {"content": "Done."})).reward == 0.0
    assert json.dumps(_initial_database(), sort_keys=True) == before


ORDER = "#W1000"
REPLACED_ROWS = {  # what each side's order ORDER is replaced by (None: left as it is), and if they match
    "neither": (None, None, True),
    "both alike, as two objects": ({"status": "cancelled"}, {"status": "cancelled"}, True),
    "a copy of the original": ({}, None, True),
    "keys in another order": ({"a": 1, "b": 2}, {"b": 2, "a": 1}, True),
    "one side only": ({"status": "cancelled"}, None, False),
    "different values": ({"address": "1 Main St"}, {"address": "2 Main St"}, False),
    "equal in Python, not in JSON (1 and 1.0)": ({"quantity": 1}, {"quantity": 1.0}, False),
    "equal in Python, not in JSON (True and 1)": ({"gift": True}, {"gift": 1}, False),
}


@pytest.mark.parametrize("case", REPLACED_ROWS)
def test_the_reward_compares_databases_as_their_json(case: str) -> None:
    """As tau-bench's hash of each whole database: equal exactly when their JSON is."""
    ours, theirs = fresh_database(), fresh_database()
    for database, change in zip((ours, theirs), REPLACED_ROWS[case][:2], strict=True):
        if change is not None:
            database["orders"][ORDER] = {**database["orders"][ORDER], **change}
    whole_json_equal = json.dumps(ours, sort_keys=True) == json.dumps(theirs, sort_keys=True)
    assert whole_json_equal is REPLACED_ROWS[case][2]
    assert databases_match(ours, theirs) is whole_json_equal


def test_tool_errors_are_observations() -> None:
    env = make_shop_env("train", UserSimConfig())
    env.reset(0)
    assert env.step(Action("get_order_details", {"order_id": "#nope"})).observation.startswith("Error:")
    assert env.step(Action("get_order_details", {})).observation.startswith("Error: bad arguments")
    assert env.step(Action("fly", {})).observation == "Unknown action fly"
    with pytest.raises(IndexError, match="out of range"):
        env.reset(10_000)
