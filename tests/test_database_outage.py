"""A database outage mid-batch wastes no work: finished results are held in memory and written once
the database answers again, no lease that expired during the outage is swept from a live worker,
and no attempt is counted as failed.

PostgreSQL only: the outage is a network cut between the service and the server (a TCP proxy that
resets its connections and refuses new ones), which an embedded SQLite file has no equivalent of.
"""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack

import httpx
import pytest
from sqlalchemy.engine import make_url

from service.app import create_app
from service.serving import serve_app
from service.sim.worker import SimWorker
from service.storage.db import Database
from tests.conftest import service_settings
from tests.support.contract import assert_trainer_contract, sim_calls
from tests.support.service_process import (
    episodes_of,
    simulated_sglang,
    submission,
    wait_batch_finished,
    wait_for,
)
from tests.support.tcp_proxy import TcpProxy

LEASE_SECONDS = 2.0
# Longer than a lease, and than the 6.2 s a result write was once retried before the episode was
# released to run again as a failed attempt.
OUTAGE_SECONDS = 9.0
TASKS, SAMPLES = 8, 2


def _calls_before(sim: SimWorker, count: int) -> dict[str, int]:
    """Generate calls per episode among the first `count` the worker received."""
    calls: dict[str, int] = {}
    for request in sim.requests[:count]:
        episode_id = request.rid.split(":")[0]
        calls[episode_id] = calls.get(episode_id, 0) + 1
    return calls


@pytest.mark.parametrize("backend", ["postgres"], indirect=True)
async def test_outage_mid_batch_reruns_nothing_and_counts_no_failure(database_url: str, db: Database) -> None:
    url = make_url(database_url)
    proxy = TcpProxy(url.host or "127.0.0.1", url.port or 5432)
    async with AsyncExitStack() as stack:
        await stack.enter_async_context(proxy.serving())
        sim, sglang_url = await stack.enter_async_context(simulated_sglang(latency_seconds=0.3))
        proxied = url.set(port=proxy.port).render_as_string(hide_password=False)
        # Two service processes' worth (two apps, each its own worker and pool), so that each one's
        # sweep sees the other's leases expire during the outage.
        settings = service_settings(
            proxied, sglang_url, lease_seconds=LEASE_SECONDS, sweep_interval_seconds=0.2
        )
        first = await stack.enter_async_context(serve_app(create_app(settings)))
        await stack.enter_async_context(serve_app(create_app(settings)))
        async with httpx.AsyncClient(base_url=first, timeout=10) as http:
            response = await http.post("/episodes", json=submission("outage", TASKS, SAMPLES))
        assert response.status_code == 202, response.text

        async def all_started() -> bool:  # some end after their first turn: "started" is all there is
            return len({r.rid.split(":")[0] for r in sim.requests}) == TASKS * SAMPLES

        await wait_for(all_started, 30, "every episode to be running")
        proxy.cut()
        await asyncio.sleep(OUTAGE_SECONDS)
        calls_at_restore = len(sim.requests)
        running_at_restore = {e.id for e in await episodes_of(db, "outage") if e.status == "running"}
        proxy.restore()
        episodes = await wait_batch_finished(db, "outage", 60)

    calls = _calls_before(sim, calls_at_restore)
    held = [e.id for e in episodes if e.id in running_at_restore and calls.get(e.id) == e.num_turns]
    assert held, "no episode finished during the outage: the test did not exercise a held result"
    for episode in episodes:
        assert episode.status in {"completed", "truncated", "aborted"}, (episode.id, episode.error)
        assert (episode.attempt, episode.failures) == (0, 0), (episode.id, episode.error)
        tokens = episode.tokens()
        assert tokens is not None
        assert_trainer_contract(
            tokens.prompt_ids,
            tokens.response_ids,
            tokens.loss_mask,
            tokens.rollout_logprobs,
            sim_calls(sim, episode.id, 0),
        )
