"""The simulated SGLang worker speaks docs/sglang.md and plays builtin/shop's oracle with seeded mistakes."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from functools import cache
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from service.envs.base import RESPOND_ACTION_NAME, Action
from service.envs.builtin.shop import SYSTEM_PROMPT, TOOLS, ShopEnv, oracle_plan, tasks
from service.records import rid_attempt_key
from service.sim.policy import AFTER_PLAN_REPLY, UNKNOWN_REPLY, parse_chatml
from service.sim.worker import SimConfig, SimWorker, _stream, create_sim_app
from tests.support.polling import until
from tests.support.tokenizer import load_test_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

NO_MISTAKES = SimConfig(
    latency_seconds=0.0,
    wrong_argument_rate=0.0,
    malformed_call_rate=0.0,
    ramble_rate=0.0,
    noncanonical_rate=0.0,
)


@cache
def tokenizer() -> PreTrainedTokenizerBase:
    return load_test_tokenizer()


def prompt_ids(messages: list[dict[str, Any]]) -> list[int]:
    text = tokenizer().apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert isinstance(text, str)
    return list(tokenizer().encode(text, add_special_tokens=False))


def first_messages(task_index: int = 0) -> list[dict[str, Any]]:
    task = tasks("train")[task_index]
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task.instruction}]


async def generate(http: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
    response = await http.post("/generate", json=body)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def body_for(ids: list[int], rid: str, **params: Any) -> dict[str, Any]:
    sampling = {"max_new_tokens": 256, **params}
    return {"input_ids": ids, "sampling_params": sampling, "return_logprob": True, "rid": rid}


def sim_client(worker: SimWorker) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=create_sim_app(worker=worker)), base_url="http://sim"
    )


@pytest.fixture
async def sim() -> AsyncIterator[tuple[SimWorker, httpx.AsyncClient]]:
    worker = SimWorker(NO_MISTAKES)
    async with sim_client(worker) as http:
        yield worker, http


def parse_action(text: str) -> Action | None:
    """The first Qwen2.5 tool call of `text`, a respond, or None if the call is malformed."""
    if "<tool_call>\n" not in text:
        return Action(RESPOND_ACTION_NAME, {"content": text})
    block = text.split("<tool_call>\n", 1)[1].split("\n</tool_call>", 1)[0]
    try:
        call = json.loads(block)
    except ValueError:
        return None
    return Action(call["name"], call["arguments"])


async def play_episode(
    http: httpx.AsyncClient, task_index: int, episode: str
) -> tuple[float | None, list[str]]:
    """A minimal orchestrator: reward (None if aborted) and the finish types of the turns."""
    env = ShopEnv("train")
    env.reset(task_index)
    messages = first_messages(task_index)
    finishes = []
    for turn in range(20):
        result = await generate(http, body_for(prompt_ids(messages), f"{episode}:{turn}"))
        finish = result["meta_info"]["finish_reason"]["type"]
        finishes.append(finish)
        action = parse_action(result["text"])
        if action is None:
            return None, finishes
        if action.name == RESPOND_ACTION_NAME:
            messages.append({"role": "assistant", "content": result["text"]})
            step = env.step(action)
            messages.append({"role": "user", "content": step.observation})
        else:
            call = {"function": {"name": action.name, "arguments": action.kwargs}}
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            step = env.step(action)
            messages.append({"role": "tool", "content": step.observation})
        if step.done:
            return step.reward, finishes
    return None, finishes


def test_parse_chatml_and_rid_attempt_key() -> None:
    text = "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi\nthere<|im_end|>\n<|im_start|>assistant\n"
    assert parse_chatml(text) == [
        ("system", "S", True),
        ("user", "Hi\nthere", True),
        ("assistant", "", False),
    ]
    assert rid_attempt_key("ep-1:0:3") == "ep-1:0"
    assert rid_attempt_key("a:b:c:4") == "a:b:c"
    assert rid_attempt_key("plain") == "plain"


async def test_oracle_plays_the_plan_and_earns_reward_one(sim: tuple[SimWorker, httpx.AsyncClient]) -> None:
    _, http = sim
    for index in range(4):
        reward, finishes = await play_episode(http, index, f"ep{index}:0")
        assert reward == 1.0
        assert set(finishes) == {"stop"}
        assert len(finishes) == len(oracle_plan(tasks("train")[index]))


async def test_first_turn_is_the_first_plan_action(sim: tuple[SimWorker, httpx.AsyncClient]) -> None:
    worker, http = sim
    task = tasks("train")[0]
    result = await generate(http, body_for(prompt_ids(first_messages()), "e:0:0"))
    first = oracle_plan(task)[0]
    call = json.dumps({"name": first.name, "arguments": first.kwargs})
    assert result["text"] == f"<tool_call>\n{call}\n</tool_call>"
    assert result["output_ids"][-1] == tokenizer().convert_tokens_to_ids("<|im_end|>")
    assert result["meta_info"]["finish_reason"] == {"type": "stop", "matched": result["output_ids"][-1]}
    assert worker.requests[0].input_ids == prompt_ids(first_messages())
    assert worker.requests[0].rid == "e:0:0"


async def test_unknown_conversation_gets_a_plain_reply(sim: tuple[SimWorker, httpx.AsyncClient]) -> None:
    _, http = sim
    messages = [{"role": "user", "content": "What is the weather like?"}]
    result = await generate(http, body_for(prompt_ids(messages), "x:0:0"))
    assert result["text"] == UNKNOWN_REPLY


async def test_reply_after_the_plan_is_a_goodbye(sim: tuple[SimWorker, httpx.AsyncClient]) -> None:
    _, http = sim
    messages = first_messages()
    for _ in oracle_plan(tasks("train")[0]):
        messages += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "fine"}]
    result = await generate(http, body_for(prompt_ids(messages), "x:0:9"))
    assert result["text"] == AFTER_PLAN_REPLY


async def test_default_mistake_rates_give_a_realistic_mix() -> None:
    worker = SimWorker(SimConfig(latency_seconds=0.0))
    async with sim_client(worker) as http:
        results = [await play_episode(http, index % 200, f"mix{index}:0") for index in range(60)]
    rewards = [reward for reward, _ in results]
    success = sum(1 for reward in rewards if reward == 1.0) / len(rewards)
    assert 0.55 <= success <= 0.95, success
    assert any(reward is None or reward == 0.0 for reward in rewards)


async def test_mistakes_are_seeded_by_episode_and_attempt() -> None:
    config = SimConfig(
        latency_seconds=0.0, wrong_argument_rate=0.5, malformed_call_rate=0.3, noncanonical_rate=0.2
    )
    async with sim_client(SimWorker(config)) as http:
        first = [await play_episode(http, 3, f"ep{n}:0") for n in range(8)]
        again = [await play_episode(http, 3, f"ep{n}:0") for n in range(8)]
        other = [await play_episode(http, 3, f"ep{n}:1") for n in range(8)]
    assert first == again
    assert first != other


@pytest.mark.parametrize(
    ("rates", "expected"),
    [({"wrong_argument_rate": 1.0}, 0.0), ({"malformed_call_rate": 1.0}, None)],
)
async def test_each_mistake_kind(rates: dict[str, float], expected: float | None) -> None:
    config = SimConfig(**{**NO_MISTAKES.__dict__, **rates})
    async with sim_client(SimWorker(config)) as http:
        for index in range(3):
            reward, _ = await play_episode(http, index, f"m{index}:0")
            assert reward == expected


async def test_ramble_is_cut_by_max_new_tokens() -> None:
    config = SimConfig(**{**NO_MISTAKES.__dict__, "ramble_rate": 1.0})
    async with sim_client(SimWorker(config)) as http:
        _, finishes = await play_episode(http, 0, "r:0")
        assert "length" in finishes


async def test_output_ids_are_noncanonical_yet_decode_to_the_text() -> None:
    config = SimConfig(**{**NO_MISTAKES.__dict__, "noncanonical_rate": 1.0})
    async with sim_client(SimWorker(config)) as http:
        result = await generate(http, body_for(prompt_ids(first_messages()), "n:0:0"))
    ids = result["output_ids"]
    eos = tokenizer().convert_tokens_to_ids("<|im_end|>")
    assert ids[-1] == eos
    assert ids[:-1] != tokenizer().encode(result["text"], add_special_tokens=False)
    assert tokenizer().decode(ids[:-1]) == result["text"]
    assert tokenizer().decode(ids, skip_special_tokens=True) == result["text"]
    # Added tokens are sampled whole, as a model does.
    assert ids[0] == tokenizer().convert_tokens_to_ids("<tool_call>")


async def test_without_stop_token_in_output_ids() -> None:
    config = SimConfig(**{**NO_MISTAKES.__dict__, "include_stop_token": False})
    async with sim_client(SimWorker(config)) as http:
        result = await generate(http, body_for(prompt_ids(first_messages()), "s:0:0"))
    eos = tokenizer().convert_tokens_to_ids("<|im_end|>")
    assert result["output_ids"][-1] != eos
    assert result["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
    assert [item[1] for item in result["meta_info"]["output_token_logprobs"]] == result["output_ids"]
    assert tokenizer().decode(result["output_ids"]) == result["text"]


async def test_logprobs_and_meta_info(sim: tuple[SimWorker, httpx.AsyncClient]) -> None:
    _, http = sim
    result = await generate(http, body_for(prompt_ids(first_messages()), "l:0:0"))
    meta = result["meta_info"]
    items = meta["output_token_logprobs"]
    assert [item[1] for item in items] == result["output_ids"]
    assert all(-3.0 < item[0] <= 0.0 and item[2] is None for item in items)
    assert meta["id"] == "l:0:0"
    assert meta["prompt_tokens"] == len(prompt_ids(first_messages()))
    assert meta["completion_tokens"] == len(result["output_ids"])
    assert meta["weight_version"] == "default"
    assert meta["cached_tokens"] == 0
    assert isinstance(meta["e2e_latency"], float)

    with_text = await generate(
        http, {**body_for(prompt_ids(first_messages()), "l2:0:0"), "return_text_in_logprobs": True}
    )
    assert (
        "".join(item[2] for item in with_text["meta_info"]["output_token_logprobs"][:-1]) == with_text["text"]
    )
    without = await generate(
        http, {**body_for(prompt_ids(first_messages()), "l3:0:0"), "return_logprob": False}
    )
    assert "output_token_logprobs" not in without["meta_info"]


async def test_same_episode_same_prompt_same_output(sim: tuple[SimWorker, httpx.AsyncClient]) -> None:
    _, http = sim
    ids = prompt_ids(first_messages())
    first = await generate(http, body_for(ids, "d:0:0"))
    again = await generate(http, body_for(ids, "d:0:0"))
    assert first["output_ids"] == again["output_ids"]
    assert first["meta_info"]["output_token_logprobs"] == again["meta_info"]["output_token_logprobs"]


async def test_second_turn_hits_the_prefix_cache(sim: tuple[SimWorker, httpx.AsyncClient]) -> None:
    _, http = sim
    messages = first_messages()
    first = await generate(http, body_for(prompt_ids(messages), "c:0:0"))
    messages += [{"role": "assistant", "content": first["text"]}, {"role": "user", "content": "ok"}]
    second = await generate(http, body_for(prompt_ids(messages), "c:0:1"))
    assert second["meta_info"]["cached_tokens"] >= first["meta_info"]["prompt_tokens"]


async def test_max_new_tokens_and_stop_token_ids(sim: tuple[SimWorker, httpx.AsyncClient]) -> None:
    _, http = sim
    ids = prompt_ids(first_messages())
    cut = await generate(http, body_for(ids, "t:0:0", max_new_tokens=5))
    assert len(cut["output_ids"]) == 5
    assert cut["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    newline = tokenizer().encode("\n", add_special_tokens=False)[0]
    stopped = await generate(http, body_for(ids, "t:0:0", stop_token_ids=[newline]))
    assert stopped["output_ids"][-1] == newline
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": newline}
    assert stopped["output_ids"].count(newline) == 1


async def test_a_stop_string_ends_the_output_at_the_token_completing_it(
    sim: tuple[SimWorker, httpx.AsyncClient],
) -> None:
    _, http = sim
    ids = prompt_ids(first_messages())
    full = (await generate(http, body_for(ids, "s:0:0")))["output_ids"]
    stop = tokenizer().decode(full)[10:14]
    stopped = await generate(http, body_for(ids, "s:0:0", stop=["never said", stop]))
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    output = stopped["output_ids"]
    assert output == full[: len(output)] and stop in tokenizer().decode(output)
    assert stop not in tokenizer().decode(output[:-1])


async def test_text_input_is_accepted(sim: tuple[SimWorker, httpx.AsyncClient]) -> None:
    worker, http = sim
    result = await generate(http, {"text": "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"})
    assert result["text"] == UNKNOWN_REPLY
    assert worker.requests[0].input_ids[0] == tokenizer().convert_tokens_to_ids("<|im_start|>")


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (b"{not json", "Invalid JSON"),
        (b'{"input_ids": [1, 2], "text": "hi"}', "Either text, input_ids"),
        (b'{"sampling_params": {}}', "Either text, input_ids"),
        (b'{"input_ids": [1, "x"]}', "input_ids"),
        (b'{"input_ids": [1, 99999]}', "token ids below"),
        (b'{"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}', "max_new_tokens"),
        (b"[1, 2]", "JSON object"),
    ],
)
async def test_bad_bodies_are_400_with_a_message(
    sim: tuple[SimWorker, httpx.AsyncClient], content: bytes, needle: str
) -> None:
    _, http = sim
    response = await http.post("/generate", content=content, headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert needle in response.json()["error"]["message"]


async def test_input_longer_than_the_context_is_400() -> None:
    async with sim_client(SimWorker(SimConfig(context_length=64, latency_seconds=0.0))) as http:
        response = await http.post("/generate", json={"input_ids": [5] * 64})
        assert response.status_code == 400
        assert "longer than the model's context length (64 tokens)" in response.json()["error"]["message"]
        response = await http.post(
            "/generate", json={"input_ids": [5] * 10, "sampling_params": {"max_new_tokens": 60}}
        )
        assert response.status_code == 400
        assert "maximum context length of 64" in response.json()["error"]["message"]


async def test_queue_limit_is_503() -> None:
    worker = SimWorker(SimConfig(latency_seconds=0.3, max_queued_requests=1))
    async with sim_client(worker) as http:
        ids = prompt_ids(first_messages())
        first = asyncio.create_task(http.post("/generate", json=body_for(ids, "q:0:0")))
        await until(lambda: worker.running == 1)
        refused = await http.post("/generate", json=body_for(ids, "q:1:0"))
        assert refused.status_code == 503
        assert (await first).status_code == 200


async def test_abort_by_rid_prefix_returns_partial_output() -> None:
    worker = SimWorker(SimConfig(**{**NO_MISTAKES.__dict__, "per_token_latency_seconds": 0.01}))
    async with sim_client(worker) as http:
        ids = prompt_ids(first_messages())
        full = await generate(http, body_for(ids, "full:0:0"))
        pending = asyncio.create_task(http.post("/generate", json=body_for(ids, "ab:0:0")))
        await asyncio.sleep(0.1)
        other = asyncio.create_task(http.post("/generate", json=body_for(ids, "other:0:0", max_new_tokens=3)))
        response = await http.post("/abort_request", json={"rid": "ab:0", "abort_all": False})
        assert response.status_code == 200
        assert response.content == b""
        result = (await pending).json()
        assert result["meta_info"]["finish_reason"]["type"] == "abort"
        assert "message" in result["meta_info"]["finish_reason"]
        assert 0 < len(result["output_ids"]) < len(full["output_ids"])
        assert result["output_ids"] == full["output_ids"][: len(result["output_ids"])]
        assert len(result["meta_info"]["output_token_logprobs"]) == len(result["output_ids"])
        assert (await other).json()["meta_info"]["finish_reason"]["type"] == "length"
        assert worker.aborts == [{"rid": "ab:0", "abort_all": False}]


async def test_abort_all() -> None:
    worker = SimWorker(SimConfig(latency_seconds=5.0))
    async with sim_client(worker) as http:
        ids = prompt_ids(first_messages())
        pending = [
            asyncio.create_task(http.post("/generate", json=body_for(ids, f"a{n}:0:0"))) for n in range(3)
        ]
        await until(lambda: worker.running == 3)
        await http.post("/abort_request", json={"rid": "", "abort_all": True})
        results = [(await task).json() for task in pending]
    assert all(result["meta_info"]["finish_reason"]["type"] == "abort" for result in results)
    assert all(result["output_ids"] == [] for result in results)


async def test_pause_and_continue() -> None:
    worker = SimWorker(SimConfig(latency_seconds=0.0))
    async with sim_client(worker) as http:
        assert (await http.post("/pause_generation")).status_code == 400
        assert (await http.post("/continue_generation")).status_code == 400
        assert (await http.post("/pause_generation", json={"mode": "retract"})).status_code == 200
        ids = prompt_ids(first_messages())
        queued = asyncio.create_task(http.post("/generate", json=body_for(ids, "p:0:0")))
        await asyncio.sleep(0.05)
        assert not queued.done()
        assert (await http.post("/continue_generation", json={})).status_code == 200
        assert (await queued).json()["meta_info"]["finish_reason"]["type"] == "stop"

        await http.post("/pause_generation", json={"mode": "retract"})
        aborted = asyncio.create_task(http.post("/generate", json=body_for(ids, "p:1:0")))
        await until(lambda: worker.running == 1)
        await http.post("/abort_request", json={"rid": "p:1"})
        meta = (await aborted).json()["meta_info"]
        assert meta["finish_reason"]["type"] == "abort"
        assert "prompt_tokens" not in meta  # aborted while queued
        await http.post("/continue_generation", json={})


async def test_update_weights_sets_the_weight_version(sim: tuple[SimWorker, httpx.AsyncClient]) -> None:
    _, http = sim
    assert (await http.get("/get_weight_version")).json() == {"weight_version": "default"}
    response = await http.post(
        "/update_weights_from_disk", json={"model_path": "/ckpt/7", "weight_version": "7"}
    )
    assert response.status_code == 200
    assert response.json()["success"] is True
    assert (await http.get("/get_weight_version")).json() == {"weight_version": "7"}
    info = (await http.get("/get_model_info")).json()
    assert info["weight_version"] == "7"
    assert info["model_path"] == "/ckpt/7"
    assert info["is_generation"] is True
    assert "tokenizer_path" in info
    result = await generate(http, body_for(prompt_ids(first_messages()), "w:0:0"))
    assert result["meta_info"]["weight_version"] == "7"
    bad = await http.post("/update_weights_from_disk", json={})
    assert bad.status_code == 400


async def test_info_endpoints(sim: tuple[SimWorker, httpx.AsyncClient]) -> None:
    worker, http = sim
    assert (await http.get("/health")).status_code == 200
    assert (await http.get("/health_generate")).status_code == 200
    assert (await http.get("/get_server_info")).json()["context_length"] == 32768
    assert (await http.get("/get_load")).json()[0]["num_reqs"] == 0
    assert (await http.get("/v1/models")).json()["data"][0]["id"] == "sim/shop-oracle"
    assert (await http.post("/flush_cache")).status_code == 200
    worker.healthy = False
    assert (await http.get("/health")).status_code == 503


async def test_streaming_frames(sim: tuple[SimWorker, httpx.AsyncClient]) -> None:
    _, http = sim
    body = body_for(prompt_ids(first_messages()), "st:0:0")
    plain = await generate(http, body)
    response = await http.post("/generate", json={**body, "stream": True})
    assert response.headers["content-type"].startswith("text/event-stream")
    frames = response.text.split("\n\n")
    assert frames[-2:] == ["data: [DONE]", ""]
    chunks = [json.loads(frame.removeprefix("data: ")) for frame in frames[:-2]]
    assert len(chunks) > 1
    assert all(chunk["meta_info"]["finish_reason"] is None for chunk in chunks[:-1])
    assert chunks[-1]["output_ids"] == plain["output_ids"]
    assert chunks[-1]["text"] == plain["text"]


async def test_an_abort_keeps_every_token_the_stream_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    """As SGLang's, an aborted stream's last frame holds every token its earlier frames sent, however
    few the worker's clock says were sampled by then: the stream's timer once fired a hair early
    (uvloop's timers count whole milliseconds), an agent left on that frame, and the last frame,
    cut by the clock, took its token back (the service refused it as an engine fault, and the call
    the agent left was not recorded: tests/test_agents_streaming.py, 5 of about 570 runs under load)."""
    worker = SimWorker(SimConfig(**{**NO_MISTAKES.__dict__, "per_token_latency_seconds": 0.01}))
    monkeypatch.setattr(SimWorker, "_produced", lambda self, elapsed, total: 0)  # the clock a hair behind
    request, running = worker._admit({**body_for(prompt_ids(first_messages()), "early:0:0"), "stream": True})
    frames = _stream(worker, request, running)
    first = json.loads((await anext(frames)).removeprefix(b"data: "))
    assert first["meta_info"]["finish_reason"] is None and len(first["output_ids"]) == 1
    assert worker.abort("early:0") == 1
    last = json.loads((await anext(frames)).removeprefix(b"data: "))
    assert [chunk async for chunk in frames] == [b"data: [DONE]\n\n"]
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert last["output_ids"] == first["output_ids"]  # extends the first frame's: not one token taken back


async def test_a_weight_update_aborts_in_flight_and_a_resumed_request_continues_the_turn() -> None:
    """As SGLang under a trainer: the update aborts each request with what it sampled so far; the
    same turn asked again from prompt + those tokens continues it exactly (ids and logprobs), and
    reports the new weight version."""
    worker = SimWorker(SimConfig(**{**NO_MISTAKES.__dict__, "per_token_latency_seconds": 0.01}))
    async with sim_client(worker) as http:
        ids = prompt_ids(first_messages())
        whole = (await generate(http, body_for(ids, "cut:0:9")))["meta_info"]["output_token_logprobs"]
        pending = asyncio.create_task(http.post("/generate", json=body_for(ids, "cut:0:0")))
        await until(lambda: worker.running == 1)
        await asyncio.sleep(0.1)
        loads = (await http.get("/v1/loads", params={"include": "core"})).json()
        assert loads["loads"][0]["num_running_reqs"] + loads["loads"][0]["num_waiting_reqs"] == 1
        assert worker.update_weights("2") == 1
        first = (await pending).json()
        assert first["meta_info"]["finish_reason"]["type"] == "abort"
        assert first["meta_info"]["weight_version"] == "default"  # sampled by the old weights
        partial = first["meta_info"]["output_token_logprobs"]
        assert 0 < len(partial) < len(whole)
        body = body_for(ids + [pair[1] for pair in partial], "cut:0:0.1", max_new_tokens=256 - len(partial))
        rest = (await generate(http, body))["meta_info"]
        assert rest["weight_version"] == "2"
        assert [pair[:2] for pair in partial + rest["output_token_logprobs"]] == [pair[:2] for pair in whole]
        idle = (await http.get("/v1/loads")).json()
        assert idle["loads"][0]["num_running_reqs"] == idle["loads"][0]["num_waiting_reqs"] == 0
        assert {"timestamp", "version", "loads"} <= idle.keys()
