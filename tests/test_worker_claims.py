"""The worker's claim loop on both databases: an idle worker only reads (a claim joins the writer's
group, on SQLite the file's write lock, even when it finds nothing), and claims as soon as work
is queued."""

from __future__ import annotations

import asyncio

from sqlalchemy import event
from sqlalchemy.exc import OperationalError

from service.records import EpisodeResult, EpisodeSpec
from service.storage.db import Database
from service.worker.worker import EpisodeWorker
from tests.conftest import service_settings
from tests.test_storage import enqueue

CLAIM_INTERVAL_SECONDS = 0.02
IDLE_SECONDS = 0.5  # 25 claim rounds
CLAIMED_WITHIN_SECONDS = 10.0


class HandingOver:
    """A runner whose every episode is handed over to its agent: the worker writes no result."""

    newest_version: int | None = None

    def __init__(self, expected: int) -> None:
        self.ran: list[str] = []
        self.all_ran = asyncio.Event()
        self._expected = expected

    async def run(self, spec: EpisodeSpec) -> EpisodeResult | None:
        self.ran.append(spec.episode_id)
        if len(self.ran) >= self._expected:
            self.all_ran.set()
        return None


async def test_an_idle_worker_writes_nothing_and_claims_what_is_queued(db: Database) -> None:
    settings = service_settings(
        db.url, "http://127.0.0.1:9", claim_interval_seconds=CLAIM_INTERVAL_SECONDS, lease_seconds=60
    )
    runner = HandingOver(expected=4)
    worker = EpisodeWorker(settings, db, runner)
    commits = 0

    def on_commit(connection: object) -> None:
        nonlocal commits
        commits += 1

    # The lease sweep writes at start; after a failure it waits for the database to answer a
    # whole lease (60 s): its writes stay out of the window watched here.
    db.status.failed(OperationalError("SELECT 1", {}, Exception("the test holds the sweep off")))
    event.listen(db.engine.sync_engine, "commit", on_commit)
    worker.start()
    try:
        try:
            await asyncio.sleep(IDLE_SECONDS)
            idle_commits = commits
            await enqueue(db, groups=2, samples=2)
            await asyncio.wait_for(runner.all_ran.wait(), CLAIMED_WITHIN_SECONDS)
        finally:
            event.remove(db.engine.sync_engine, "commit", on_commit)
    finally:
        await worker.stop(timeout=0)
    assert idle_commits == 0, f"{idle_commits} commits in {IDLE_SECONDS} s with nothing queued"
    assert len(runner.ran) == 4  # claimed within a claim interval or so
