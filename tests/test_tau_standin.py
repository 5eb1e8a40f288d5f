"""Our tau-bench adapter and user simulator against a stand-in tau_bench and a stub OpenAI server."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from service.envs.base import Action, UserSimConfig
from service.envs.errors import EnvError
from service.envs.host import EnvHost
from service.envs.registry import TAU_BENCH_ENVS, available_envs, tau_bench_installed
from service.envs.tau import TauBenchEnvironment
from service.envs.user_sim import AGENT_GREETING, UserSimulatorError
from service.loop.runner import EpisodeRunner
from service.loop.toolcalls import get_parser
from service.records import EpisodeRequest, EpisodeSpec, EpisodeStatus
from tests.support.engines import FixedReplies
from tests.support.openai_stub import StubServer, closed_port_url, openai_stub
from tests.support.tokenizer import chat_tokenizer

STANDIN_DIR = Path(__file__).parent / "tau_standin"
TAU_ENVS = {spec.name: spec for spec in TAU_BENCH_ENVS}
FIRST_LINE = "Hi, I'd like to cancel my order #W1, I no longer need it."
CANCEL_W1 = [
    Action("get_order_details", {"order_id": "#W1"}),
    Action("cancel_pending_order", {"order_id": "#W1", "reason": "no longer needed"}),
    Action("respond", {"content": "Order #W1 is cancelled; its total was $1,250.5."}),
]


def shop_user(messages: list[dict[str, Any]]) -> str:
    if len(messages) == 2:
        return FIRST_LINE
    if "cancelled" in messages[-1]["content"]:
        return "Great, thanks! ###STOP###"
    return "Yes, go ahead please."


def forget_tau_bench() -> None:
    for name in [name for name in sys.modules if name == "tau_bench" or name.startswith("tau_bench.")]:
        del sys.modules[name]


@pytest.fixture
def standin(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    spec = importlib.util.find_spec("tau_bench")
    if spec is not None and not str(spec.origin).startswith(str(STANDIN_DIR)):
        pytest.skip("the real tau_bench is installed; tests/test_tau_integration.py covers it")
    forget_tau_bench()
    monkeypatch.syspath_prepend(str(STANDIN_DIR))
    # Spawned env workers get sys.path from the parent; PYTHONPATH covers any other start method.
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(STANDIN_DIR), os.environ.get("PYTHONPATH")]))
    )
    yield
    forget_tau_bench()


@pytest.fixture
def user_server() -> Iterator[StubServer]:
    with openai_stub(shop_user) as server:
        yield server


def sim_config(server: StubServer) -> UserSimConfig:
    return UserSimConfig(base_url=server.base_url, model="user-model", api_key="k", temperature=0.7, seed=42)


def test_adapter_plays_an_episode(standin: None, user_server: StubServer) -> None:
    env = TauBenchEnvironment("retail", "test", sim_config(user_server))
    assert env.system_prompt.startswith("# Order desk policy")
    assert [tool["function"]["name"] for tool in env.tools] == [
        "get_order_details",
        "cancel_pending_order",
        "transfer_to_human_agents",
    ]
    assert env.num_tasks == 2

    reset = env.reset(0)
    assert reset.observation == FIRST_LINE
    # Ground truth for the trainer's records.
    assert reset.info["task"]["actions"][1] == {
        "name": "cancel_pending_order",
        "kwargs": {"order_id": "#W1", "reason": "no longer needed"},
    }
    assert reset.info["task"]["outputs"] == ["1250.5"]
    assert reset.info["source"] == "user"

    steps = [env.step(action) for action in CANCEL_W1]
    assert [(s.reward, s.done) for s in steps] == [(0.0, False), (0.0, False), (1.0, True)]
    assert '"status": "pending"' in steps[0].observation
    assert steps[0].info["source"] == "get_order_details"
    final = steps[-1]
    assert final.observation == "Great, thanks! ###STOP###"
    assert final.info["reward_info"]["reward"] == 1.0
    assert final.info["reward_info"]["info"] == {"r_outputs": 1.0, "outputs": {"1250.5": True}}
    assert final.info["user_cost"] == 0.0
    assert env._env.reward_computations == 1
    with pytest.raises(RuntimeError, match="after done"):
        env.step(CANCEL_W1[-1])

    # One call at reset, one per respond; every call carries our sampling settings.
    assert len(user_server.requests) == 2
    for body, headers in zip(user_server.requests, user_server.headers, strict=True):
        assert body["model"] == "user-model"
        assert body["temperature"] == 0.7
        assert body["seed"] == 42
        assert headers["authorization"] == "Bearer k"
    first, second = user_server.requests
    assert first["messages"][0]["role"] == "system"
    assert "Instruction: You are Ada. Cancel order #W1" in first["messages"][0]["content"]
    assert "###STOP###" in first["messages"][0]["content"]
    assert first["messages"][1] == {"role": "user", "content": AGENT_GREETING}
    assert second["messages"][2:] == [
        {"role": "assistant", "content": FIRST_LINE},
        {"role": "user", "content": CANCEL_W1[-1].kwargs["content"]},
    ]


def test_wrong_actions_get_no_reward(standin: None, user_server: StubServer) -> None:
    env = TauBenchEnvironment("retail", "test", sim_config(user_server))
    env.reset(0)
    assert env.step(Action("get_order_details", {"order_id": "#W9"})).observation.startswith("Error: ")
    assert env.step(Action("refund_everything", {})).observation == "Unknown action refund_everything"
    final = env.step(Action("respond", {"content": "It is cancelled."}))
    assert (final.reward, final.done) == (0.0, True)
    assert final.info["reward_info"]["info"]["outputs"] == {"1250.5": False}


def test_adapter_checks_task_index_and_split(standin: None, user_server: StubServer) -> None:
    env = TauBenchEnvironment("airline", "test", sim_config(user_server))
    with pytest.raises(IndexError, match="airline/test has 1 tasks"):
        env.reset(1)
    with pytest.raises(ValueError, match="Unknown task split"):
        TauBenchEnvironment("airline", "train", sim_config(user_server))
    with pytest.raises(ValueError, match="unknown tau-bench domain"):
        TauBenchEnvironment("telecom", "test", sim_config(user_server))


def test_user_simulator_down_is_a_clear_error(standin: None) -> None:
    env = TauBenchEnvironment("retail", "test", UserSimConfig(base_url=closed_port_url(), model="m"))
    with pytest.raises(UserSimulatorError, match="unreachable"):
        env.reset(0)
    with pytest.raises(UserSimulatorError, match="no user simulator endpoint"):
        TauBenchEnvironment("retail", "test", UserSimConfig())


@pytest.fixture
async def tau_host(standin: None, user_server: StubServer) -> AsyncIterator[EnvHost]:
    host = EnvHost(workers=2, executor="process", user_sim=sim_config(user_server), envs=TAU_ENVS)
    yield host
    await host.close()


async def test_episode_in_env_workers(tau_host: EnvHost, user_server: StubServer) -> None:
    session = await tau_host.open("tau-bench/retail", "test", "ep-1")
    assert session.pid != os.getpid()
    assert session.system_prompt.startswith("# Order desk policy")
    reset = await session.reset(0)
    assert reset.observation == FIRST_LINE
    steps = [await session.step(action) for action in CANCEL_W1]
    assert (steps[-1].reward, steps[-1].done) == (1.0, True)
    assert steps[-1].info["task"]["actions"][0]["name"] == "get_order_details"
    await session.close()
    assert [(body["temperature"], body["seed"]) for body in user_server.requests] == [(0.7, 42)] * 2


async def test_user_simulator_down_in_env_workers(standin: None) -> None:
    host = EnvHost(workers=1, user_sim=UserSimConfig(base_url=closed_port_url(), model="m"), envs=TAU_ENVS)
    try:
        session = await host.open("tau-bench/airline", "test", "ep")
        with pytest.raises(EnvError) as caught:
            await session.reset(0)
        assert caught.value.exc_type == "service.envs.user_sim.UserSimulatorError"
        assert "unreachable" in caught.value.message
        await session.close()
    finally:
        await host.close()


async def test_user_simulator_down_fails_the_episode_with_the_reason(standin: None) -> None:
    """Infrastructure, not the policy's fault: `failed` (not trained on), with the error recorded."""
    host = EnvHost(workers=1, user_sim=UserSimConfig(base_url=closed_port_url(), model="m"), envs=TAU_ENVS)
    try:
        spec = EpisodeSpec(
            "ep", 0, EpisodeRequest("tau-bench/retail", "test", 0, {"max_new_tokens": 32}, max_turns=3)
        )
        result = await EpisodeRunner(FixedReplies([]), host, chat_tokenizer(), get_parser("qwen25")).run(spec)
    finally:
        await host.close()
    assert result.status is EpisodeStatus.FAILED
    assert result.error is not None and "UserSimulatorError" in result.error and "unreachable" in result.error


def test_registry_lists_tau_bench_when_importable(standin: None) -> None:
    assert tau_bench_installed()
    assert TAU_ENVS["tau-bench/retail"].splits == {"train": 500, "test": 115, "dev": 20}
    assert TAU_ENVS["tau-bench/airline"].splits == {"test": 50}
    pytest.importorskip("service.envs.builtin", reason="the built-in environments are not written yet")
    envs = available_envs()
    assert {"tau-bench/retail", "tau-bench/airline"} <= envs.keys()
    assert any(name.startswith("builtin/") for name in envs)


def test_registry_without_tau_bench() -> None:
    if tau_bench_installed():
        pytest.skip("tau_bench is installed")
    pytest.importorskip("service.envs.builtin", reason="the built-in environments are not written yet")
    envs = available_envs()
    assert not any(name.startswith("tau-bench/") for name in envs)
    assert "builtin/shop" in envs
    assert "tau_bench" not in sys.modules and "litellm" not in sys.modules
