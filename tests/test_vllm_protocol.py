"""ENGINE=vllm against the simulated worker's vLLM side: the client, the mapping of sampling
parameters, aborts by prefix, pause and resume, and whole episodes meeting the trainer contract.
The simulated worker's answers are checked against one recorded from vLLM 0.32 itself
(tests/support/vllm_0_32_generate.json, from `POST /inference/v1/generate`)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.app import create_app
from service.engine.client import EngineRequestError, make_control_client
from service.engine.transport import SocketTransport
from service.engine.vllm import VLLMClient, parse_vllm_generation, unsupported_by_vllm, vllm_sampling_params
from service.serving import serve_app
from service.sim.worker import SimConfig, SimWorker, create_sim_app, serve_in_thread
from tests.conftest import one_shop_episode, service_settings
from tests.support.contract import assert_stored_episode_matches_sim
from tests.support.polling import until

RECORDED = Path(__file__).parent / "support" / "vllm_0_32_generate.json"


def _shape(value: Any) -> Any:
    """A JSON value's keys in order and its leaves' types, values left out."""
    if isinstance(value, dict):
        return [(key, _shape(item)) for key, item in value.items()]
    if isinstance(value, list):
        return [_shape(value[0])] if value else []
    return type(value).__name__


def test_sampling_params_map_to_vllm_names_or_are_named_as_missing() -> None:
    params = {
        "max_new_tokens": 64,
        "min_new_tokens": 2,
        "temperature": 0.7,
        "top_k": 20,
        "stop": ["\n\n"],
        "stop_token_ids": [2],
        "no_stop_trim": True,
        "sampling_seed": 5,
        "regex": "a+",
        "stream_interval": 4,
    }
    assert vllm_sampling_params(params) == {
        "max_tokens": 64,
        "min_tokens": 2,
        "temperature": 0.7,
        "top_k": 20,
        "stop": ["\n\n"],
        "stop_token_ids": [2],
        "include_stop_str_in_output": True,
        "seed": 5,
        "structured_outputs": {"regex": "a+"},
        "logprobs": 0,
    }
    assert unsupported_by_vllm(params) is None
    # Without stop strings vLLM need not detokenize (the answer carries no text either way).
    without_stop = {name: value for name, value in params.items() if name != "stop"}
    assert vllm_sampling_params(without_stop)["detokenize"] is False
    assert vllm_sampling_params(without_stop | {"stop": []})["detokenize"] is False
    assert unsupported_by_vllm({"max_new_tokens": 8, "stop_regex": ["x"]}) == "stop_regex"
    assert unsupported_by_vllm({"custom_params": {"a": 1}}) == "custom_params"
    with pytest.raises(EngineRequestError, match="stop_regex"):
        vllm_sampling_params({"stop_regex": ["x"]})


def test_a_recorded_vllm_answer_parses_into_a_generation() -> None:
    generation = parse_vllm_generation(json.loads(RECORDED.read_bytes()))
    assert generation.output_ids == [3918, 1008, 362]
    assert generation.logprobs == [-6.076372146606445, -0.32983335852622986, -4.057981967926025]
    assert generation.finish_type == "length" and generation.finish_reason == {"type": "length", "length": 3}
    assert generation.weight_version == "default" and generation.prompt_tokens == 3
    assert generation.has_logprobs and not generation.interrupted


def test_finish_reasons_read_as_sglang_writes_them() -> None:
    body = json.loads(RECORDED.read_bytes())
    choice = body["choices"][0]
    for finish, stop_reason, expected in [
        ("stop", None, {"type": "stop", "matched": 362}),  # EOS: the last token
        ("stop", 7, {"type": "stop", "matched": 7}),
        ("stop", "\n\n", {"type": "stop", "matched": "\n\n"}),
        ("abort", None, {"type": "abort", "message": "aborted by vLLM"}),
    ]:
        choice.update(finish_reason=finish, stop_reason=stop_reason)
        generation = parse_vllm_generation(body)
        assert generation.finish_reason == expected
        assert generation.interrupted == (finish == "abort")


async def test_the_simulated_worker_answers_as_vllm_does() -> None:
    worker = SimWorker(SimConfig(latency_seconds=0.0))
    app = create_sim_app(worker.config, worker=worker)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://sim") as http:
        body = {
            "token_ids": [1, 882, 198],
            "sampling_params": {"max_tokens": 3, "temperature": 1.0, "logprobs": 0},
            "request_id": "e:0:0",
        }
        response = await http.post("/inference/v1/generate", json=body)
        assert response.status_code == 200
        recorded = json.loads(RECORDED.read_bytes())
        answered = response.json()
        assert _shape(answered) == _shape(recorded)
        assert answered["request_id"] == recorded["request_id"] == "generate-tokens-e:0:0"
        # Compact JSON, as Starlette's JSONResponse writes it.
        assert response.content == json.dumps(answered, separators=(",", ":"), ensure_ascii=False).encode()
        # What the client sends without stop strings: the same answer (vLLM's tokens mode has no text).
        untexted = body | {"sampling_params": body["sampling_params"] | {"detokenize": False}}
        bare = await http.post("/inference/v1/generate", json=untexted)
        assert bare.json()["choices"] == answered["choices"]
        stop_untexted = untexted | {"sampling_params": untexted["sampling_params"] | {"stop": ["x"]}}
        refused = await http.post("/inference/v1/generate", json=stop_untexted)
        assert refused.status_code == 400 and "detokenize" in refused.json()["error"]["message"]
        too_long = await http.post("/inference/v1/generate", json=body | {"token_ids": [5] * 40_000})
        assert too_long.status_code == 400
        assert "maximum model length" in too_long.json()["error"]["message"]


async def test_abort_by_prefix_reaches_the_ids_in_flight() -> None:
    worker = SimWorker(SimConfig(latency_seconds=0.0, per_token_latency_seconds=0.05))
    with serve_in_thread(create_sim_app(worker.config, worker=worker)) as url:
        http = make_control_client(10.0)
        transport = SocketTransport()
        client = VLLMClient(
            http, url, max_inflight=8, retries=0, backoff_seconds=0.0, timeout_seconds=30.0,
            transport=transport,
        )  # fmt: skip
        try:
            params = {"max_new_tokens": 400, "ignore_eos": True}
            running = asyncio.ensure_future(client.generate([1, 882, 198], params, "ep:0:3"))
            await until(lambda: worker.running == 1, timeout_seconds=10.0)
            await client.abort("ep:0:")
            generation = await running
            assert generation.finish_type == "abort" and generation.interrupted
            assert len(generation.output_ids) == len(generation.logprobs) < 400
            assert worker.aborts == [{"request_ids": ["generate-tokens-ep:0:3"]}]
            assert client._live == {}  # an ended call's id is no longer aborted by prefix
            await client.abort("ep:0:")  # nothing in flight: no call at all
            assert len(worker.aborts) == 1
        finally:
            await transport.aclose()
            await http.aclose()


async def test_episodes_on_the_vllm_protocol_meet_the_trainer_contract(
    database_url: str, sim: tuple[SimWorker, str]
) -> None:
    worker, url = sim
    app = create_app(service_settings(database_url, url, engine="vllm"))
    async with serve_app(app) as base, httpx.AsyncClient(base_url=base, timeout=30) as client:
        refused = await client.post(
            "/episodes",
            json=one_shop_episode({"stop_regex": ["x"]}),
        )
        assert refused.status_code == 422, refused.text
        assert "stop_regex" in refused.text and "vLLM" in refused.text
        submitted = await client.post(
            "/episodes",
            json={
                "env": "builtin/shop",
                "task_split": "test",
                "task_indices": [0, 1],
                "samples_per_task": 2,
                "sampling_params": {"temperature": 0.7, "max_new_tokens": 200},
                "max_turns": 10,
            },
        )
        assert submitted.status_code == 202, submitted.text
        batch = (await client.get(f"/batches/{submitted.json()['batch_id']}", params={"wait": 60})).json()
        assert batch["complete"], batch["counts"]
        for summary in batch["episodes"]:
            episode = (await client.get(f"/episodes/{summary['id']}")).json()
            assert episode["status"] in {"completed", "truncated", "aborted"}
            assert_stored_episode_matches_sim(worker, episode)
        assert all(request.body.get("token_ids") for request in worker.requests)  # vLLM's route only

        paused = await client.post("/engine/pause", json={"mode": "retract"})
        assert paused.status_code == 200, paused.text
        assert (await client.get("/ready")).status_code == 503
        assert worker.waiting == 0 and worker._paused  # vLLM's keep: new requests wait
        resumed = await client.post("/engine/continue")
        assert resumed.status_code == 200, resumed.text
        assert not worker._paused


async def test_control_calls_go_to_the_server_without_asking_it_for_workers() -> None:
    """vLLM has no router: a pause or an abort is one request to a server that may be busy
    generating, not a GET /workers first."""

    def nothing_asked(request: httpx.Request) -> httpx.Response:
        raise AssertionError(f"asked {request.url}")

    async with httpx.AsyncClient(transport=httpx.MockTransport(nothing_asked)) as http:
        client = VLLMClient(
            http, "http://vllm:8000/", max_inflight=1, retries=0, backoff_seconds=0.0, timeout_seconds=1.0
        )
        assert await client.workers() == ["http://vllm:8000"]
        configured = VLLMClient(
            http, "http://vllm:8000", max_inflight=1, retries=0, backoff_seconds=0.0, timeout_seconds=1.0,
            worker_urls=["http://a:1", "http://b:2"],
        )  # fmt: skip
        assert await configured.workers() == ["http://a:1", "http://b:2"]
