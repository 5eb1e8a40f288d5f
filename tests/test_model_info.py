"""The engine's context length and logprobs mode, read from the engine (service/engine/model_info.py)
on both protocols against the simulated worker: max_new_tokens cut to what the context leaves, an
input that fills it refused before any call, and every turn recording where its logprobs came from."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from service.app import create_app
from service.engine.client import EngineRequestError, SGLangClient
from service.engine.model_info import ModelInfoCache, read_model_info, vllm_logprobs_mode
from service.engine.vllm import VLLMClient
from service.serving import serve_app
from service.sim.worker import SimConfig, SimWorker, create_sim_app, serve_in_thread
from tests.conftest import one_shop_episode, service_settings

CONTEXT = 300
ENGINES = {"sglang": SGLangClient, "vllm": VLLMClient}
MAX_TOKENS_NAME = {"sglang": "max_new_tokens", "vllm": "max_tokens"}


@pytest.fixture
def worker() -> SimWorker:
    return SimWorker(SimConfig(context_length=CONTEXT, latency_seconds=0.0))


@pytest.fixture
async def http(worker: SimWorker) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(create_sim_app(worker.config, worker=worker))
    async with httpx.AsyncClient(transport=transport, base_url="http://sim") as client:
        yield client


def engine_client(engine: str, http: httpx.AsyncClient, logprobs_mode: str = "auto") -> SGLangClient:
    return ENGINES[engine](
        http, "http://sim", max_inflight=4, retries=0, backoff_seconds=0.0, timeout_seconds=10.0,
        model_info=ModelInfoCache(http, "http://sim", engine, logprobs_mode),
    )  # fmt: skip


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
async def test_max_new_tokens_is_cut_to_what_the_context_leaves(
    engine: str, worker: SimWorker, http: httpx.AsyncClient
) -> None:
    client = engine_client(engine, http)
    prompt = [5] * 250
    generation = await client.generate(prompt, {"max_new_tokens": 200, "ignore_eos": True}, "ctx:0:0")
    assert client.model_info is not None and client.model_info.info.context_length == CONTEXT
    room = CONTEXT - len(prompt) - client.CONTEXT_RESERVE  # SGLang refuses reaching it, vLLM beyond
    (sent,) = worker.requests
    assert sent.body["sampling_params"][MAX_TOKENS_NAME[engine]] == room
    assert len(generation.output_ids) <= room
    assert generation.logprobs_mode == "processed"  # vLLM's flag, read from it; SGLang's default
    # Asked for less than the room: sent as asked.
    await client.generate(prompt, {"max_new_tokens": 7}, "ctx:0:1")
    assert worker.requests[-1].body["sampling_params"][MAX_TOKENS_NAME[engine]] == 7


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
async def test_an_input_that_fills_the_context_is_refused_before_any_call(
    engine: str, worker: SimWorker, http: httpx.AsyncClient
) -> None:
    client = engine_client(engine, http)
    full = [5] * (CONTEXT - client.CONTEXT_RESERVE)
    with pytest.raises(EngineRequestError) as raised:
        await client.generate(full, {"max_new_tokens": 8}, "full:0:0")
    assert raised.value.status_code == 400 and not raised.value.retryable
    assert "context length (300 tokens)" in raised.value.message  # the loop's "context length reached"
    assert worker.requests == []
    # One token of room is still asked for.
    await client.generate(full[:-1], {"max_new_tokens": 8}, "full:0:1")
    assert worker.requests[-1].body["sampling_params"][MAX_TOKENS_NAME[engine]] == 1


async def test_the_engines_word_wins_unless_the_setting_says(http: httpx.AsyncClient) -> None:
    assert (await read_model_info(http, "http://sim", "vllm", "auto")).logprobs_mode == "processed"
    assert (await read_model_info(http, "http://sim", "sglang", "auto")).logprobs_mode == "processed"
    assert (await read_model_info(http, "http://sim", "sglang", "raw")).logprobs_mode == "raw"
    for mode, word in [
        ("raw_logprobs", "raw"),
        ("processed_logprobs", "processed"),
        ("raw_logits", "raw_logits"),
    ]:
        assert vllm_logprobs_mode({"vllm_config": {"model_config": {"logprobs_mode": mode}}}) == word
    assert vllm_logprobs_mode({"detail": "Not Found"}) is None


async def test_an_engine_that_does_not_answer_is_read_again_later() -> None:
    asked: list[str] = []

    def not_up(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.path)
        return httpx.Response(503)

    async with httpx.AsyncClient(transport=httpx.MockTransport(not_up)) as http:
        cache = ModelInfoCache(http, "http://engine", "vllm", "auto")
        assert (await cache.get()).context_length is None
        assert cache.info.logprobs_mode is None
        assert asked == ["/v1/models", "/server_info"]
        await cache.get()  # kept for RETRY_AFTER_SECONDS: not asked again
        assert len(asked) == 2
        cache._expires = 0.0  # RETRY_AFTER_SECONDS later
        await cache.get()
        assert asked[2:] == ["/v1/models", "/server_info"]
        await cache.aclose()


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
async def test_each_turn_records_its_logprobs_mode_and_long_turns_fit_the_context(
    database_url: str, engine: str
) -> None:
    """An episode whose max_new_tokens outgrows the model: its turns are cut to the context (they
    used to be refused, ending the episode before its first token), and each records the mode."""
    worker = SimWorker(SimConfig(context_length=4096, latency_seconds=0.0))
    with serve_in_thread(create_sim_app(worker.config, worker=worker)) as url:
        settings = service_settings(database_url, url, engine=engine, engine_logprobs_mode="auto")
        async with (
            serve_app(create_app(settings)) as base,
            httpx.AsyncClient(base_url=base, timeout=30) as client,
        ):
            submitted = await client.post(
                "/episodes",
                json=one_shop_episode({"max_new_tokens": 40_000}, max_turns=10),
            )
            assert submitted.status_code == 202, submitted.text
            batch = (await client.get(f"/batches/{submitted.json()['batch_id']}", params={"wait": 60})).json()
            assert batch["complete"]
            episode = (await client.get(f"/episodes/{batch['episodes'][0]['id']}")).json()
    # Before, the first turn was refused ("context length"): truncated with no token sampled.
    # (The simulated policy's noise may abort or truncate it otherwise: bad calls, the turn limit.)
    assert episode["status"] != "failed" and "context length" not in (episode["error"] or ""), episode[
        "error"
    ]
    assert episode["response_ids"]
    assert episode["turns"] and {turn["logprobs_mode"] for turn in episode["turns"]} == {"processed"}
    for request in worker.requests:
        sent = request.body["sampling_params"][MAX_TOKENS_NAME[engine]]
        assert len(request.input_ids) + sent <= 4096
