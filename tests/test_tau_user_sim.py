"""The user simulator at the protocol level (httpx.MockTransport): what it sends, how it fails."""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx
import pytest

from service.envs.base import UserSimConfig
from service.envs.user_sim import AGENT_GREETING, STOP_TOKEN, OpenAIUserSimulator, UserSimulatorError

CONFIG = UserSimConfig(base_url="http://sim.test/v1/", model="sim", api_key="secret", temperature=0.3, seed=7)


def reply(content: object, status: int = 200) -> httpx.Response:
    return httpx.Response(
        status,
        json={
            "choices": [{"message": {"role": "assistant", "content": content}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2},
        },
    )


def simulator(
    handler: Callable[[httpx.Request], httpx.Response], config: UserSimConfig = CONFIG, retries: int = 0
) -> OpenAIUserSimulator:
    client = httpx.Client(transport=httpx.MockTransport(handler))
    return OpenAIUserSimulator(config, client=client, retries=retries, backoff_seconds=0)


def test_every_call_carries_model_temperature_and_seed() -> None:
    requests: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        requests.append(request)
        return reply(f"line {len(requests)}")

    user = simulator(handler)
    assert user.reset("Cancel order #1.") == "line 1"
    assert user.step("Which order?") == "line 2"
    assert user.step("Done.") == "line 3"
    assert len(requests) == 3
    for request in requests:
        assert str(request.url) == "http://sim.test/v1/chat/completions"
        assert request.headers["authorization"] == "Bearer secret"
        body = json.loads(request.content)
        assert (body["model"], body["temperature"], body["seed"]) == ("sim", 0.3, 7)
    last = json.loads(requests[-1].content)["messages"]
    assert [m["role"] for m in last] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert last[1]["content"] == AGENT_GREETING
    assert "Instruction: Cancel order #1." in last[0]["content"]
    assert STOP_TOKEN in last[0]["content"]
    assert user.messages[-1] == {"role": "assistant", "content": "line 3"}
    assert (user.calls, user.prompt_tokens, user.completion_tokens) == (3, 9, 6)
    assert user.get_total_cost() == 0.0


def test_reset_starts_a_new_conversation() -> None:
    user = simulator(lambda request: reply("hello"))
    user.reset("first")
    user.step("x")
    user.reset("second")
    assert len(user.messages) == 3
    assert "Instruction: second" in user.messages[0]["content"]


def test_no_seed_no_key() -> None:
    bodies: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(request)
        return reply("hi")

    simulator(handler, UserSimConfig(base_url="http://sim.test/v1", model="sim")).reset(None)
    body = json.loads(bodies[0].content)
    assert "seed" not in body and body["temperature"] == 0.0
    assert "authorization" not in bodies[0].headers
    assert "Instruction:" not in body["messages"][0]["content"]


def test_server_errors_are_retried_then_raised() -> None:
    statuses = iter([503, 502, 200])
    assert simulator(lambda request: reply("ok", next(statuses)), retries=2).reset("x") == "ok"
    with pytest.raises(UserSimulatorError, match="HTTP 500"):
        simulator(lambda request: httpx.Response(500, text="overloaded"), retries=1).reset("x")


def test_client_error_is_not_retried() -> None:
    calls: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        return httpx.Response(404, text="model not found")

    with pytest.raises(UserSimulatorError, match="HTTP 404: model not found"):
        simulator(handler, retries=3).reset("x")
    assert len(calls) == 1


def test_unreachable_endpoint() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    with pytest.raises(UserSimulatorError, match="unreachable: ConnectError: connection refused"):
        simulator(handler, retries=2).reset("x")


@pytest.mark.parametrize(
    ("response", "match"),
    [
        (httpx.Response(200, text="<html>"), "non-JSON"),
        (httpx.Response(200, json={"choices": []}), r"no choices\[0\]\.message"),
        (reply(None), "no text content"),
    ],
)
def test_malformed_replies(response: httpx.Response, match: str) -> None:
    with pytest.raises(UserSimulatorError, match=match):
        simulator(lambda request: response).reset("x")


def test_needs_an_endpoint() -> None:
    with pytest.raises(UserSimulatorError, match="USER_SIM_BASE_URL"):
        OpenAIUserSimulator(UserSimConfig())
