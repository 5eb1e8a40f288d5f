"""The built-in shop environment: its oracle earns 1.0, mistakes 0.0, and episodes never share state."""

from __future__ import annotations

import json

import pytest

from service.envs.base import RESPOND_ACTION_NAME, Action, UserSimConfig
from service.envs.builtin.shop import SPLIT_SIZES, _initial_database, make_shop_env, oracle_plan, tasks


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


def test_tool_errors_are_observations() -> None:
    env = make_shop_env("train", UserSimConfig())
    env.reset(0)
    assert env.step(Action("get_order_details", {"order_id": "#nope"})).observation.startswith("Error:")
    assert env.step(Action("get_order_details", {})).observation.startswith("Error: bad arguments")
    assert env.step(Action("fly", {})).observation == "Unknown action fly"
    with pytest.raises(IndexError, match="out of range"):
        env.reset(10_000)
