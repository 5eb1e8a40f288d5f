"""SGLangClient against the simulated worker (in-process and over a real socket) and its parsing."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest
import uvloop

from service.engine.client import (
    EngineError,
    EngineRequestError,
    EngineResponseError,
    EngineUnavailableError,
    Generation,
    SGLangClient,
    make_control_client,
    parse_generation,
)
from service.engine.transport import KEEPALIVE_SECONDS, GenerateTransport, SocketTransport
from service.envs.builtin.shop import SYSTEM_PROMPT, TOOLS, tasks
from service.sim.worker import SimConfig, SimWorker, create_sim_app, serve_in_thread
from tests.support.polling import until
from tests.support.ports import refused_url
from tests.support.tokenizer import load_test_tokenizer

FAST = SimConfig(latency_seconds=0.0, noncanonical_rate=0.5)


def eos() -> int:
    return int(load_test_tokenizer().convert_tokens_to_ids("<|im_end|>"))


def prompt() -> list[int]:
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": tasks("train")[0].instruction},
    ]
    tokenizer = load_test_tokenizer()
    text = tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def make_client(http: httpx.AsyncClient, base_url: str = "http://sim", **overrides: Any) -> SGLangClient:
    options: dict[str, Any] = {
        "max_inflight": 8,
        "retries": 3,
        "backoff_seconds": 0.001,
        "timeout_seconds": 5.0,
    } | overrides
    return SGLangClient(http, base_url, **options)


@pytest.fixture
def worker() -> SimWorker:
    return SimWorker(FAST)


@pytest.fixture
async def http(worker: SimWorker) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_sim_app(worker=worker))) as client:
        yield client


async def test_generate_sends_only_router_fields_and_parses(
    worker: SimWorker, http: httpx.AsyncClient
) -> None:
    client = make_client(http)
    ids = prompt()
    generation = await client.generate(ids, {"max_new_tokens": 200, "temperature": 1.0}, "ep:0:0")
    assert worker.requests[0].body == {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 200, "temperature": 1.0},
        "return_logprob": True,
        "rid": "ep:0:0",
    }
    assert generation.finish_type == "stop"
    assert generation.finish_reason == {"type": "stop", "matched": eos()}
    assert generation.output_ids[-1] == eos()
    assert len(generation.logprobs) == len(generation.output_ids)
    assert all(-3.0 < logprob <= 0.0 for logprob in generation.logprobs)
    assert generation.weight_version == "default"
    assert generation.prompt_tokens == len(ids)
    assert generation.cached_tokens == 0
    assert generation.text.startswith("<tool_call>\n")


async def test_output_ids_are_noncanonical_yet_decode_to_the_text(http: httpx.AsyncClient) -> None:
    generation = await make_client(http).generate(prompt(), {"max_new_tokens": 200}, "nc:0:0")
    body_ids = generation.output_ids[:-1]
    assert body_ids != load_test_tokenizer().encode(generation.text, add_special_tokens=False)
    assert load_test_tokenizer().decode(body_ids) == generation.text


async def test_without_the_stop_token() -> None:
    worker = SimWorker(SimConfig(latency_seconds=0.0, include_stop_token=False))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_sim_app(worker=worker))) as http:
        generation = await make_client(http).generate(prompt(), {"max_new_tokens": 200}, "ns:0:0")
    assert generation.finish_type == "stop"
    assert generation.output_ids[-1] != eos()
    assert load_test_tokenizer().decode(generation.output_ids) == generation.text
    assert len(generation.logprobs) == len(generation.output_ids)


async def test_length_finish(http: httpx.AsyncClient) -> None:
    generation = await make_client(http).generate(prompt(), {"max_new_tokens": 4}, "len:0:0")
    assert generation.finish_type == "length"
    assert generation.finish_reason == {"type": "length", "length": 4}
    assert len(generation.output_ids) == 4


async def test_retries_503_then_succeeds(worker: SimWorker, http: httpx.AsyncClient) -> None:
    worker.fail_next(2, 503)
    generation = await make_client(http).generate(prompt(), {"max_new_tokens": 50}, "r:0:0")
    assert generation.finish_type in ("stop", "length")
    assert len(worker.requests) == 3
    assert {request.rid for request in worker.requests} == {"r:0:0"}


@pytest.mark.parametrize("status", [408, 429, 500, 502])
async def test_retryable_statuses(worker: SimWorker, http: httpx.AsyncClient, status: int) -> None:
    worker.fail_next(1, status)
    await make_client(http).generate(prompt(), {"max_new_tokens": 50}, "r:0:0")
    assert len(worker.requests) == 2


async def test_retries_exhausted(worker: SimWorker, http: httpx.AsyncClient) -> None:
    worker.fail_next(10, 503)
    with pytest.raises(EngineUnavailableError) as raised:
        await make_client(http, retries=2).generate(prompt(), {"max_new_tokens": 50}, "r:0:0")
    assert raised.value.retryable is True
    assert raised.value.status_code == 503
    assert len(worker.requests) == 3


async def test_400_is_not_retried_and_keeps_the_message(worker: SimWorker) -> None:
    attempts = []

    async def count(request: httpx.Request) -> None:
        attempts.append(request.url.path)

    transport = httpx.ASGITransport(app=create_sim_app(worker=worker))
    async with httpx.AsyncClient(transport=transport, event_hooks={"request": [count]}) as http:
        too_long = [5] * FAST.context_length
        with pytest.raises(EngineRequestError) as raised:
            await make_client(http).generate(too_long, {"max_new_tokens": 1}, "big:0:0")
    assert raised.value.retryable is False
    assert raised.value.status_code == 400
    assert "longer than the model's context length" in str(raised.value)
    assert attempts == ["/generate"]


async def test_connection_refused_is_retried_then_fails() -> None:
    attempts = []

    async def count(request: httpx.Request) -> None:
        attempts.append(request.url.path)

    with refused_url() as url:
        async with httpx.AsyncClient(event_hooks={"request": [count]}) as http:
            client = make_client(http, url, retries=2)
            with pytest.raises(EngineError) as raised:
                await client.generate([1, 2, 3], {}, "c:0:0")
            assert raised.value.retryable is True
            assert raised.value.status_code is None
            assert attempts == ["/generate"] * 3
            assert await client.health() is False


async def test_timeout_is_retried() -> None:
    worker = SimWorker(SimConfig(latency_seconds=2.0))
    with serve_in_thread(create_sim_app(worker=worker)) as url:
        async with httpx.AsyncClient() as http:
            client = make_client(http, url, retries=1, timeout_seconds=0.1)
            with pytest.raises(EngineUnavailableError, match="ReadTimeout"):
                await client.generate(prompt(), {"max_new_tokens": 8}, "slow:0:0")
            # Aborted twice over: the client asks, and the worker saw the client go away.
            await until(lambda: worker.running == 0)
    assert [request.rid for request in worker.requests] == ["slow:0:0", "slow:0:0.retry1"]
    assert worker.aborts == [
        {"rid": "slow:0:0", "abort_all": False},
        {"rid": "slow:0:0.retry1", "abort_all": False},
    ]
    assert worker.running == 0


async def test_over_a_real_socket() -> None:
    worker = SimWorker(FAST)
    with serve_in_thread(create_sim_app(worker=worker)) as url:
        async with httpx.AsyncClient() as http:
            client = make_client(http, url)
            assert await client.health() is True
            info = (await http.get(f"{url}/get_model_info")).json()
            assert info["is_generation"] is True
            assert info["weight_version"] == "default"
            assert await client.workers() == [url]
            generation = await client.generate(prompt(), {"max_new_tokens": 200}, "sock:0:0")
    assert worker.requests[0].response_body is not None
    assert (
        parse_generation(httpx.Response(200, content=worker.requests[0].response_body).json()) == generation
    )


async def test_abort_mid_generation_returns_partial_output(worker: SimWorker) -> None:
    slow = SimWorker(SimConfig(latency_seconds=0.0, per_token_latency_seconds=0.01))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_sim_app(worker=slow))) as http:
        client = make_client(http)
        # Two turns of one episode's attempt ("ab:0"), the same prompt: the simulated worker plans the
        # same output for both (its noncanonical splits are drawn per attempt, so a request of
        # another episode diverged from the 19th token on, which a slow sleep below reached).
        full = await client.generate(prompt(), {"max_new_tokens": 200}, "ab:0:0")
        pending = asyncio.create_task(client.generate(prompt(), {"max_new_tokens": 200}, "ab:0:1"))
        await asyncio.sleep(0.1)
        await client.abort("ab:0")
        generation = await pending
    assert generation.finish_type == "abort"
    assert 0 < len(generation.output_ids) < len(full.output_ids)
    assert generation.output_ids == full.output_ids[: len(generation.output_ids)]
    assert len(generation.logprobs) == len(generation.output_ids)
    assert slow.aborts == [{"rid": "ab:0", "abort_all": False}]


async def test_abort_goes_to_every_configured_worker() -> None:
    workers = [SimWorker(FAST), SimWorker(FAST)]
    mounts = {
        f"http://w{n}": httpx.ASGITransport(app=create_sim_app(worker=worker))
        for n, worker in enumerate(workers)
    }
    async with httpx.AsyncClient(mounts=mounts) as http:
        client = make_client(http, "http://router", worker_urls=["http://w0", "http://w1/"])
        assert await client.workers() == ["http://w0", "http://w1"]
        await client.abort("ep7:")
    assert [worker.aborts for worker in workers] == [[{"rid": "ep7:", "abort_all": False}]] * 2


async def test_max_inflight_bounds_concurrent_generates() -> None:
    worker = SimWorker(SimConfig(latency_seconds=0.05))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_sim_app(worker=worker))) as http:
        client = make_client(http, max_inflight=2)
        await asyncio.gather(
            *(client.generate(prompt(), {"max_new_tokens": 8}, f"m{n}:0:0") for n in range(6))
        )
    assert worker.peak_running == 2


def response_body(meta: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"text": "hi", "meta_info": {"finish_reason": {"type": "stop", "matched": 2}, **meta}, **fields}


def test_parse_logprobs_with_and_without_the_stop_token() -> None:
    with_stop = parse_generation(
        response_body(
            {"output_token_logprobs": [[-0.5, 10, None], [-0.25, 2, None]], "weight_version": "3"},
            output_ids=[10, 2],
        )
    )
    assert (with_stop.output_ids, with_stop.logprobs) == ([10, 2], [-0.5, -0.25])
    assert with_stop.weight_version == "3"
    without_stop = parse_generation(
        response_body({"output_token_logprobs": [[-0.5, 10, "h"]]}, output_ids=[10])
    )
    assert (without_stop.output_ids, without_stop.logprobs) == ([10], [-0.5])
    assert without_stop.prompt_tokens is None
    assert without_stop.cached_tokens is None
    whole = parse_generation(response_body({"output_token_logprobs": [[0, 10, None], [-1, 2, None]]}))
    assert whole.logprobs == [0.0, -1.0] and all(type(value) is float for value in whole.logprobs)


def test_parse_prefers_logprob_ids_and_warns_on_disagreement(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="service.engine.client"):
        generation = parse_generation(
            response_body({"output_token_logprobs": [[-0.5, 10, None], [-0.1, 11, None]]}, output_ids=[10])
        )
    assert generation.output_ids == [10, 11]
    assert "disagree" in caplog.text


def test_parse_without_logprobs_falls_back_to_output_ids() -> None:
    generation = parse_generation(response_body({"prompt_tokens": 5, "cached_tokens": 3}, output_ids=[7, 8]))
    assert generation == Generation(
        [7, 8], [0.0, 0.0], "stop", {"type": "stop", "matched": 2}, None, 5, 3, "hi", has_logprobs=False
    )


def test_parse_abort_while_queued() -> None:
    body = {"text": "", "meta_info": {"id": "x", "finish_reason": {"type": "abort", "message": "Abort"}}}
    generation = parse_generation(body)
    assert (generation.output_ids, generation.finish_type, generation.prompt_tokens) == ([], "abort", None)


def test_parse_ignores_unknown_keys_and_maps_unknown_finish_types() -> None:
    body = response_body({"spec_verify_ct": 0, "finish_reason": {"type": "error"}}, output_ids=[], extra=1)
    assert parse_generation(body).finish_type == "abort"


@pytest.mark.parametrize(
    "body",
    [
        [],
        {"text": "x"},
        {"meta_info": {"finish_reason": None}, "output_ids": [1]},
        response_body({}),
        response_body({"output_token_logprobs": [[-0.1]]}),
        response_body({"output_token_logprobs": [[None, 1, None]]}),
        response_body({"output_token_logprobs": [[-0.1, "1", None]]}),
        response_body({"output_token_logprobs": [[-0.1, True, None]]}),
        response_body({"output_token_logprobs": [[False, 1, None]]}),
        response_body({"output_token_logprobs": [[-0.1, 1, None], "nope"]}),
        response_body({"output_token_logprobs": "nope"}),
        response_body({}, output_ids=[1, 2.5]),
    ],
)
def test_parse_rejects_malformed_bodies(body: Any) -> None:
    with pytest.raises(EngineResponseError) as raised:
        parse_generation(body)
    assert raised.value.retryable is False


async def test_malformed_200_is_not_retried() -> None:
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        return httpx.Response(200, json={"text": "x", "output_ids": [1], "meta_info": {}})

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
        with pytest.raises(EngineResponseError):
            await make_client(http).generate([1], {}, "bad:0:0")
    assert len(calls) == 1


async def test_workers_from_a_router_listing() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/workers"
        return httpx.Response(
            200, json={"workers": [{"url": "http://a:1"}, {"url": "http://b:2/"}], "total": 2}
        )

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
        assert await make_client(http, "http://router").workers() == ["http://a:1", "http://b:2"]


async def test_the_control_client_drops_idle_connections_before_the_engine_does() -> None:
    """SGLang's uvicorn closes a connection idle 5 s: a health probe or a /workers listing sent on
    one as it closes would fail. Past KEEPALIVE_SECONDS idle the control client connects anew."""
    peers: list[int] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peers.append(writer.get_extra_info("peername")[1])
        with contextlib.suppress(asyncio.IncompleteReadError):  # the client closed it
            while await reader.readuntil(b"\r\n\r\n"):
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        writer.close()

    async with raw_http_server(answer) as url, make_control_client(5.0) as http:
        assert (await http.get(f"{url}/health")).status_code == 200
        assert (await http.get(f"{url}/health")).status_code == 200
        assert len(peers) == 1  # kept alive while fresh
        await asyncio.sleep(KEEPALIVE_SECONDS + 0.3)
        assert (await http.get(f"{url}/health")).status_code == 200
    assert len(peers) == 2 and KEEPALIVE_SECONDS < 5.0


@contextlib.asynccontextmanager
async def raw_http_server(
    handle: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
) -> AsyncIterator[str]:
    """A bare asyncio server on loopback whose connections `handle` answers, by its URL. The
    server's side of each connection is closed on the way out, not collected in a later test."""
    writers: list[asyncio.StreamWriter] = []

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        await handle(reader, writer)

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        for writer in writers:
            writer.close()
        server.close()
        await server.wait_closed()


# ---- the production transport over real sockets ----


@pytest.fixture
def transport_factory() -> Callable[[], GenerateTransport]:
    return SocketTransport


async def six_generations(url: str, transport: GenerateTransport) -> list[Generation]:
    try:
        async with httpx.AsyncClient() as http:
            client = make_client(http, url, transport=transport)
            return await asyncio.gather(
                *(client.generate(prompt(), {"max_new_tokens": 200}, f"a{n}:0:0") for n in range(6))
            )
    finally:
        await transport.aclose()


def assert_answered_as_sent(worker: SimWorker, generations: list[Generation]) -> None:
    by_rid = {request.rid: request for request in worker.requests}
    for n, generation in enumerate(generations):
        body = by_rid[f"a{n}:0:0"].response_body
        assert body is not None and parse_generation(httpx.Response(200, content=body).json()) == generation
        assert by_rid[f"a{n}:0:0"].body["input_ids"] == prompt()


async def test_the_transport_returns_what_the_worker_sent(
    transport_factory: Callable[[], GenerateTransport],
) -> None:
    worker = SimWorker(FAST)
    with serve_in_thread(create_sim_app(worker=worker)) as url:
        generations = await six_generations(url, transport_factory())
    assert_answered_as_sent(worker, generations)


def test_the_socket_transport_on_uvloop() -> None:
    """The service runs on uvloop, whose transports are not asyncio's own classes."""
    worker = SimWorker(FAST)
    with serve_in_thread(create_sim_app(worker=worker)) as url:
        generations = uvloop.run(six_generations(url, SocketTransport()))
    assert_answered_as_sent(worker, generations)


async def test_the_transport_retries_a_refused_connection_then_fails(
    transport_factory: Callable[[], GenerateTransport],
) -> None:
    transport = transport_factory()
    try:
        with refused_url() as url:
            async with httpx.AsyncClient() as http:
                client = make_client(http, url, retries=2, transport=transport)
                with pytest.raises(
                    EngineUnavailableError, match="after 3 attempts: cannot connect: ConnectionRefused"
                ) as raised:
                    await client.generate([1, 2, 3], {}, "c:0:0")
    finally:
        await transport.aclose()
    assert raised.value.retryable is True and raised.value.status_code is None


async def test_the_transport_times_out_aborts_and_retries_under_a_new_rid(
    transport_factory: Callable[[], GenerateTransport],
) -> None:
    worker = SimWorker(SimConfig(latency_seconds=2.0))
    with serve_in_thread(create_sim_app(worker=worker)) as url:
        transport = transport_factory()
        try:
            async with httpx.AsyncClient() as http:
                client = make_client(http, url, retries=1, timeout_seconds=0.1, transport=transport)
                with pytest.raises(EngineUnavailableError, match="TimeoutError"):
                    await client.generate(prompt(), {"max_new_tokens": 8}, "slow:0:0")
                await until(lambda: worker.running == 0)
        finally:
            await transport.aclose()
    assert [request.rid for request in worker.requests] == ["slow:0:0", "slow:0:0.retry1"]
    assert {"rid": "slow:0:0", "abort_all": False} in worker.aborts


async def test_a_read_on_a_kept_alive_connection_closed_under_it_is_sent_again() -> None:
    """The engine's server closes a kept-alive connection just as a request goes out on it (its idle
    timeout, or a client whose event loop stalled past its own expiry): the control client sends a
    GET (a health probe, the router's workers), idempotent, once more on a new connection, and a
    live engine is not reported unreachable (/ready); a POST (a pause) is sent once."""
    requests: list[int] = []  # per request: the connection it came on
    connections = itertools.count(1)

    async def answer_once_then_drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connection = next(connections)
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while await reader.readuntil(b"\r\n\r\n"):
                requests.append(connection)
                if requests.count(connection) > 1:  # its second request: closed without an answer
                    break
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        writer.close()

    async with raw_http_server(answer_once_then_drop) as url, make_control_client(5.0) as http:
        client = make_client(http, url)
        assert await client.health()
        assert await client.health()  # sent on the kept connection, dropped, sent again
        assert await client._health_problem() is None
        assert await client.workers() == [url]  # GET /workers answered 200 "ok": not a router
        with pytest.raises(httpx.RemoteProtocolError):
            await http.post(f"{url}/pause")
    assert requests == [1, 1, 2, 2, 3, 3, 4, 4]
