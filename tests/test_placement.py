"""Episode-sticky placement of generate calls over several simulated SGLang workers: one worker per
episode, a group's episodes together while load allows, and failover when a worker goes away."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack

import pytest

from service.engine.client import SGLangClient
from service.engine.placement import GROUP_SLACK_CALLS, Placement, Route, current_route
from service.engine.transport import SocketTransport
from service.sim.prefix_cache import PrefixCache
from service.sim.worker import SimConfig, SimWorker, create_sim_app, serve_in_thread
from tests.test_router import messages_of, prompt_ids

URLS = ["http://w0", "http://w1", "http://w2", "http://w3"]


def test_an_episode_stays_on_its_worker_and_its_group_joins_it() -> None:
    placement = Placement(URLS)
    first = placement.pick(Route("e0", "g0"))
    assert all(placement.pick(Route("e0", "g0")) == first for _ in range(5))
    assert placement.pick(Route("e1", "g0")) == first  # the group's prompt is cached there
    others = {placement.pick(Route(f"solo{i}")) for i in range(len(URLS) * 3)}
    assert others == set(URLS)  # idle workers take new episodes in turn


def test_a_busy_group_worker_sends_new_episodes_elsewhere() -> None:
    placement = Placement(URLS)
    home = placement.pick(Route("e0", "g0"))
    for _ in range(GROUP_SLACK_CALLS + 1):
        placement.started(home)
    elsewhere = placement.pick(Route("e1", "g0"))
    assert elsewhere != home
    assert placement.pick(Route("e0", "g0")) == home  # a running episode does not move for load
    placement.finished(home)
    assert placement.pick(Route("e2", "g0")) in (home, elsewhere)


def test_a_failed_worker_moves_its_episodes() -> None:
    placement = Placement(URLS)
    home = placement.pick(Route("e0", "g0"))
    placement.failed(home)
    moved = placement.pick(Route("e0", "g0"))
    assert moved != home and placement.moves == 1
    assert placement.pick(Route("e0", "g0")) == moved  # and stays on its new worker


def test_round_robin_spreads_every_call() -> None:
    placement = Placement(URLS, "round_robin")
    assert [placement.pick(Route("e0", "g0")) for _ in range(8)] == URLS * 2


def test_the_prefix_cache_matches_to_the_token_and_evicts_least_recent() -> None:
    cache = PrefixCache(capacity_tokens=64, page_tokens=4)
    keys = cache.insert(list(range(20)))
    assert cache.match(list(range(20))) == (20, keys)
    assert cache.match([*range(13), 99, 100])[0] == 13  # within a page, to the token
    assert cache.match([5, *range(1, 20)])[0] == 0
    cache.insert(list(range(24)), keys)  # extended from the known keys: the same pages, one more
    assert cache.match(list(range(30)))[0] == 24
    cache.insert(list(range(100, 160)))  # 15 pages: the older sequence's last pages go
    assert cache.tokens <= 64
    assert cache.match(list(range(20)))[0] < 20


@pytest.fixture
def sims() -> Iterator[dict[str, SimWorker]]:
    workers = [SimWorker(SimConfig(latency_seconds=0.0)) for _ in range(3)]
    with ExitStack() as stack:
        urls = [stack.enter_context(serve_in_thread(create_sim_app(worker=sim))) for sim in workers]
        yield dict(zip(urls, workers, strict=True))


def served_by(sims: dict[str, SimWorker]) -> dict[str, set[str]]:
    """Episode id -> the workers its calls reached."""
    where: dict[str, set[str]] = {}
    for url, sim in sims.items():
        for request in sim.requests:
            where.setdefault(request.rid.split(":")[0], set()).add(url)
    return where


async def play(client: SGLangClient, episode: str, group: str, task: int, turns: int) -> list[int]:
    """Plays `turns` calls of one episode as the loop does (each turn resends the conversation)."""
    current_route.set(Route(episode, group))
    context, cached = prompt_ids(messages_of(task)), []
    for turn in range(turns):
        generation = await client.generate(context, {"max_new_tokens": 64}, f"{episode}:0:{turn}")
        cached.append(generation.cached_tokens or 0)
        context += generation.output_ids
    return cached


def client_over(urls: list[str], transport: SocketTransport, http_client: object) -> SGLangClient:
    return SGLangClient(
        http_client,  # type: ignore[arg-type]  # only control calls use it
        urls[0],
        max_inflight=16,
        retries=3,
        backoff_seconds=0.01,
        timeout_seconds=30.0,
        worker_urls=urls,
        transport=transport,
        placement=Placement(urls),
    )


async def test_episodes_stick_to_one_worker_and_hit_its_cache(sims: dict[str, SimWorker]) -> None:
    transport = SocketTransport()
    client = client_over(list(sims), transport, None)
    try:
        for group in range(3):
            for sample in range(2):
                cached = await play(client, f"g{group}s{sample}", f"b/{group}", group, turns=3)
                assert all(hit > 0 for hit in cached[1:])
                if sample == 1:
                    assert cached[0] > 0  # the group's prompt was cached by its first sample
    finally:
        await transport.aclose()
    where = served_by(sims)
    assert all(len(urls) == 1 for urls in where.values()), where
    assert len(set().union(*where.values())) == 3  # groups spread over the workers


async def test_a_worker_that_goes_away_moves_its_episode_without_losing_the_turn() -> None:
    kept, leaving = SimWorker(SimConfig(latency_seconds=0.0)), SimWorker(SimConfig(latency_seconds=0.0))
    transport = SocketTransport()
    with serve_in_thread(create_sim_app(worker=kept)) as kept_url, ExitStack() as stack:
        leaving_url = stack.enter_context(serve_in_thread(create_sim_app(worker=leaving)))
        client = client_over([leaving_url, kept_url], transport, None)
        assert client.placement is not None
        try:
            current_route.set(Route("e0", "g0"))
            context = prompt_ids(messages_of(0))
            client.placement._groups["g0"] = leaving_url  # the group lives on the worker that leaves
            first = await client.generate(context, {"max_new_tokens": 64}, "e0:0:0")
            assert [request.rid for request in leaving.requests] == ["e0:0:0"]
            stack.close()  # the worker stops: its connections drop, new ones are refused
            context += first.output_ids
            second = await client.generate(context, {"max_new_tokens": 64}, "e0:0:1")
        finally:
            await transport.aclose()
    assert second.finish_type in ("stop", "length") and second.output_ids
    assert [request.rid.split(".")[0] for request in kept.requests] == ["e0:0:1"]
    assert client.placement.moves == 1
