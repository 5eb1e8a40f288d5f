"""The real `sglang-router` 0.3.2 wheel between SGLangClient and two simulated workers."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.engine.client import EngineRequestError, SGLangClient
from service.engine.placement import Route, current_route
from service.envs.builtin.shop import SYSTEM_PROMPT, TOOLS, tasks
from service.sim.worker import SimConfig, SimWorker, create_sim_app, serve_in_thread
from tests.support.polling import until
from tests.support.ports import free_port
from tests.support.tokenizer import load_test_tokenizer

ROUTER_START_TIMEOUT_SECONDS = 60.0
ROUTER_STOP_TIMEOUT_SECONDS = 10.0
# Fields the router 0.3.2 adds when it rebuilds a /generate request from its typed schema (all defaults).
ROUTER_DEFAULT_FIELDS = {
    "model": None,
    "return_text_in_logprobs": False,
    "stream": False,
    "log_metrics": True,
    "return_hidden_states": False,
    "background": False,
    "no_logs": False,
    "return_bytes": False,
    "return_entropy": False,
}


@dataclass
class RouterSetup:
    url: str
    workers: dict[str, SimWorker]  # worker URL -> its simulated worker
    log: Path


def wait_ready(router_url: str, process: subprocess.Popen[bytes], log: Path) -> None:
    """Until the router is healthy and lists both workers."""
    deadline = time.monotonic() + ROUTER_START_TIMEOUT_SECONDS
    with httpx.Client(timeout=2.0) as http:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                tail = log.read_text(errors="replace")[-2000:]
                raise AssertionError(f"sglang-router exited with {process.returncode}: {tail}")
            try:
                if http.get(f"{router_url}/health").status_code == 200:
                    listed = http.get(f"{router_url}/workers").json().get("workers", [])
                    if len(listed) == 2 and all(worker.get("is_healthy") for worker in listed):
                        return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
    raise AssertionError(f"router not ready in {ROUTER_START_TIMEOUT_SECONDS}s: {log.read_text()[-2000:]}")


@pytest.fixture
def router(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[RouterSetup]:
    policy = getattr(request, "param", "cache_aware")
    sims = [SimWorker(SimConfig(latency_seconds=0.0)) for _ in range(2)]
    with ExitStack() as stack:
        urls = [stack.enter_context(serve_in_thread(create_sim_app(worker=sim))) for sim in sims]
        router_url = f"http://127.0.0.1:{free_port()}"
        log = tmp_path / "router.log"
        command = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *urls]
        command += ["--host", "127.0.0.1", "--port", router_url.rsplit(":", 1)[1], "--policy", policy]
        # Its metrics exporter listens on port 29000 unless told: a second router on the machine (a
        # test on another xdist worker) panicked at start with "Address already in use", and the
        # test skipped as if the router could not run here.
        command += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        if policy == "manual":  # a new key goes to the worker with the fewest keys
            command += ["--assignment-mode", "min_group"]
        with log.open("wb") as output:
            process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
        try:
            wait_ready(router_url, process, log)
            yield RouterSetup(router_url, dict(zip(urls, sims, strict=True)), log)
        finally:
            process.terminate()
            try:
                process.wait(ROUTER_STOP_TIMEOUT_SECONDS)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(ROUTER_STOP_TIMEOUT_SECONDS)


def messages_of(task_index: int) -> list[dict[str, Any]]:
    task = tasks("train")[task_index]
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task.instruction}]


def prompt_ids(messages: list[dict[str, Any]]) -> list[int]:
    tokenizer = load_test_tokenizer()
    text = tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def client_for(http: httpx.AsyncClient, url: str) -> SGLangClient:
    return SGLangClient(http, url, max_inflight=16, retries=2, backoff_seconds=0.01, timeout_seconds=30.0)


def requests_by_rid(setup: RouterSetup) -> dict[str, tuple[str, Any]]:
    return {request.rid: (url, request) for url, sim in setup.workers.items() for request in sim.requests}


async def test_requests_pass_through_with_our_fields_and_byte_identical_responses(
    router: RouterSetup,
) -> None:
    async with httpx.AsyncClient(timeout=30.0) as http:
        sent: dict[str, dict[str, Any]] = {}
        raw: dict[str, bytes] = {}
        for episode in range(6):
            rid = f"ep{episode}:0:0"
            sampling = {"max_new_tokens": 300, "temperature": 0.7, "top_p": 1.0, "stop_token_ids": [2]}
            sent[rid] = {"input_ids": prompt_ids(messages_of(episode)), "sampling_params": sampling}
            sent[rid] |= {"return_logprob": True, "rid": rid}
            response = await http.post(f"{router.url}/generate", json=sent[rid])
            assert response.status_code == 200, response.text
            raw[rid] = response.content

        generation = await client_for(http, router.url).generate(
            sent["ep0:0:0"]["input_ids"], sent["ep0:0:0"]["sampling_params"], "ep0:1:0"
        )
        assert generation.finish_type == "stop"

    received = requests_by_rid(router)
    assert set(received) == {*sent, "ep0:1:0"}
    for rid, body in sent.items():
        _, request = received[rid]
        assert {key: request.body[key] for key in body} == body
        extra = {key: value for key, value in request.body.items() if key not in body}
        assert extra.items() <= ROUTER_DEFAULT_FIELDS.items(), extra
        assert request.response_body == raw[rid]  # the router passes the response through byte for byte
    _, ours = received["ep0:1:0"]
    assert {key: ours.body[key] for key in sent["ep0:0:0"]} == {**sent["ep0:0:0"], "rid": "ep0:1:0"}


async def test_multi_turn_episode_stays_on_one_worker(router: RouterSetup) -> None:
    """Each turn extends the last prompt, so cache-aware routing keeps the episode on its worker.

    (At low load router 0.3.2 sends everything to one worker; it spreads only past its balance
    thresholds, and then a few episodes change workers: 4 of 200 in a manual run.)
    """
    async with httpx.AsyncClient(timeout=30.0) as http:
        client = client_for(http, router.url)
        for episode in range(4):
            messages = messages_of(episode)
            for turn in range(3):
                generation = await client.generate(
                    prompt_ids(messages), {"max_new_tokens": 300}, f"e{episode}:0:{turn}"
                )
                messages += [
                    {"role": "assistant", "content": generation.text},
                    {"role": "user", "content": "ok"},
                ]
    received = requests_by_rid(router)
    for episode in range(4):
        assert len({received[f"e{episode}:0:{turn}"][0] for turn in range(3)}) == 1


async def test_workers_are_read_from_the_router_and_aborts_go_to_them(router: RouterSetup) -> None:
    for sim in router.workers.values():
        sim.config = replace(sim.config, per_token_latency_seconds=0.02)
    async with httpx.AsyncClient(timeout=30.0) as http:
        client = client_for(http, router.url)
        assert sorted(await client.workers()) == sorted(router.workers)
        # The router does not proxy /abort_request.
        assert (await http.post(f"{router.url}/abort_request", json={"rid": "x"})).status_code == 404

        pending = asyncio.create_task(
            client.generate(prompt_ids(messages_of(0)), {"max_new_tokens": 300}, "ab:0:0")
        )
        await until(lambda: any(sim.running for sim in router.workers.values()))
        await asyncio.sleep(0.2)
        await client.abort("ab:0:")
        generation = await asyncio.wait_for(pending, 10.0)
    assert generation.finish_type == "abort"
    assert 0 < len(generation.output_ids) == len(generation.logprobs)
    for sim in router.workers.values():
        assert sim.aborts == [{"rid": "ab:0:", "abort_all": False}]


async def test_400_passes_through_the_router_unretried(router: RouterSetup) -> None:
    async with httpx.AsyncClient(timeout=30.0) as http:
        with pytest.raises(EngineRequestError) as raised:
            await client_for(http, router.url).generate([5] * 40_000, {"max_new_tokens": 1}, "big:0:0")
    assert raised.value.status_code == 400
    assert "longer than the model's context length" in raised.value.message


@pytest.mark.parametrize("router", ["manual"], indirect=True)
async def test_groups_stay_on_one_worker_by_the_routing_key(router: RouterSetup) -> None:
    """The router's manual policy pins the routing key the client sends (the episode's group):
    every call of a group's episodes lands on one worker, and later turns hit its prefix cache."""
    async with httpx.AsyncClient(timeout=30.0) as http:
        client = client_for(http, router.url)
        cached = []
        for group in range(12):  # 6 keys fell on one of the 2 workers once (a 1-in-32 draw if hashed)
            ids = prompt_ids(messages_of(group))
            for sample in range(3):
                current_route.set(Route(f"g{group}s{sample}", f"batch/{group}"))
                context = list(ids)
                for turn in range(2):
                    rid = f"g{group}s{sample}:0:{turn}"
                    generation = await client.generate(context, {"max_new_tokens": 64}, rid)
                    cached.append(generation.cached_tokens or 0)
                    context += generation.output_ids
    by_group: dict[str, set[str]] = {}
    for rid, (url, _) in requests_by_rid(router).items():
        by_group.setdefault(rid.split("s")[0], set()).add(url)
    assert all(len(urls) == 1 for urls in by_group.values()), by_group
    assert len(set().union(*by_group.values())) == 2  # the groups spread over both workers
    assert all(hit > 0 for hit in cached[1:3])  # the group's other samples share its cached prompt
