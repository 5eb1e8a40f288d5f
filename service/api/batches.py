"""GET /batches/{id}: what the trainer pulls, as JSON or as an Arrow IPC stream, with long-poll;
POST /batches/{id}/cancel: what it no longer wants; GET /batches and GET /batches/{id}/episodes:
what people look at (the viewer)."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Response

from service.api.access import AccessDep, BatchId
from service.api.arrow import ARROW_STREAM_MEDIA_TYPE
from service.api.batch_json import batch_summary_json, summary_item
from service.api.contract import link
from service.api.deps import LONG_POLL_CUT, ServicesDep, long_poll
from service.api.errors import DatabaseUnavailable, NotFound, responses
from service.api.schemas import (
    BATCH_ID_PATTERN,
    BatchEpisodesOut,
    BatchListItem,
    BatchListOut,
    BatchOut,
    CancelOut,
)
from service.api.streaming import arrow_stream, tokens_json_stream
from service.app_state import Services
from service.records import FINISHED_STATUSES, EpisodeStatus, attempt_rid_prefix
from service.storage.batch_rows import CHUNK_BYTES, open_batch_rows
from service.storage.batches import batch_finished, cancel_batch
from service.storage.browse import UnknownCursor, batch_episode_summaries, list_batches

router = APIRouter(tags=["batches"])

JSON_SIZE_FACTOR = 4  # a token's JSON text against its stored bytes, about
CANCEL_ABORTS_AT_ONCE = 64  # engine aborts of a cancelled batch in flight together
MAX_BATCHES_PAGE = 500


@router.get(
    "/batches",
    operation_id="list_batches",
    response_model=BatchListOut,
    responses=responses(NotFound, DatabaseUnavailable)
    | {
        200: {
            "links": {
                "newest": link("get_batch", "The newest batch.", batch_id="$response.body#/batches/0/id")
            }
        }
    },
)
async def get_batches(
    services: ServicesDep,
    access: AccessDep,
    limit: Annotated[int, Query(ge=1, le=MAX_BATCHES_PAGE, description="Batches per page.")] = 50,
    before: Annotated[
        str | None,
        Query(max_length=128, pattern=BATCH_ID_PATTERN, description="The previous page's `next`."),
    ] = None,
) -> BatchListOut:
    """Batches, newest first, a page at a time: counts by status and reward mean so far. A project
    key (API_PROJECTS) lists its project's batches only."""
    try:
        if before is not None and not access.owns(before):
            raise UnknownCursor(before)
        page = await list_batches(services.database, limit=limit, before=before, prefix=access.batch_prefix)
    except UnknownCursor:
        raise NotFound(f"no batch {before!r} to page from (before=)") from None
    return BatchListOut(
        batches=[
            BatchListItem(
                **listing.batch,
                counts=listing.counts,
                total=sum(listing.counts.values()),
                reward_mean=listing.reward_mean,
            )
            for listing in page.batches
        ],
        next=page.next,
    )


@router.get(
    "/batches/{batch_id}/episodes",
    operation_id="list_batch_episodes",
    response_model=BatchEpisodesOut,
    responses=responses(NotFound, DatabaseUnavailable),
)
async def get_batch_episodes(
    services: ServicesDep,
    batch_id: BatchId,
    status: Annotated[
        list[EpisodeStatus] | None, Query(description="Only episodes with one of these statuses.")
    ] = None,
) -> Response:
    """Every episode of the batch, finished or not (`GET /batches/{id}` lists complete groups only),
    summarized: no tokens, no transcript."""
    found = await batch_episode_summaries(services.database, batch_id, [str(value) for value in status or ()])
    if found is None:
        raise NotFound(f"no batch {batch_id!r}")
    batch, rows = found
    unfinished = any(row.status not in FINISHED_STATUSES for row in rows)
    waiting = await services.engine.status.check() if unfinished and not status else None
    body = BatchEpisodesOut.model_validate(
        {**batch, "waiting_for_engine": waiting, "episodes": [summary_item(row) for row in rows]}
    )
    return Response(body.model_dump_json(), media_type="application/json")


@router.get(
    "/batches/{batch_id}",
    operation_id="get_batch",
    response_model=BatchOut,
    responses={
        **responses(NotFound, DatabaseUnavailable),
        200: {
            "description": "The batch as JSON, or with `Accept: application/vnd.apache.arrow.stream` an "
            "Arrow IPC stream with one row per episode of the complete groups, token arrays included.",
            "content": {ARROW_STREAM_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}},
        },
    },
)
async def get_batch_results(
    services: ServicesDep,
    batch_id: BatchId,
    wait: Annotated[
        float,
        Query(
            ge=0,
            allow_inf_nan=False,
            description="Long-poll: seconds to wait for the batch to complete" + LONG_POLL_CUT,
        ),
    ] = 0,
    include_tokens: Annotated[bool, Query(description="JSON: add each episode's token arrays.")] = False,
    accept: Annotated[str, Header()] = "application/json",
) -> Any:
    """Counts by status and the episodes of complete groups (a GRPO group arrives whole)."""
    if wait > 0:  # an unknown batch has nothing unfinished: no wait, then 404
        await long_poll(services, wait, lambda: _complete(services, batch_id))
    if ARROW_STREAM_MEDIA_TYPE not in accept and not include_tokens:
        body = await services.summary_reads.read(batch_id, lambda: _summary(services, batch_id))
        if body is None:
            raise NotFound(f"no batch {batch_id!r}")
        return Response(body, media_type="application/json")
    # JSON token pulls weigh about three times their blobs: smaller chunks hold as much in memory.
    arrow = ARROW_STREAM_MEDIA_TYPE in accept
    chunk_bytes = CHUNK_BYTES if arrow else CHUNK_BYTES // JSON_SIZE_FACTOR
    rows = await open_batch_rows(services.database, batch_id, chunk_bytes=chunk_bytes)
    if rows is None:  # decided before the stream starts: past its status line it cannot be a 404
        raise NotFound(f"no batch {batch_id!r}")
    return arrow_stream(rows) if arrow else tokens_json_stream(rows)


@router.post(
    "/batches/{batch_id}/cancel",
    operation_id="cancel_batch",
    response_model=CancelOut,
    responses=responses(NotFound, DatabaseUnavailable),
)
async def cancel(services: ServicesDep, batch_id: BatchId) -> CancelOut:
    """Ends the batch's queued and running episodes `cancelled`; finished ones stay as they are.
    Idempotent. Running episodes stop at once: here by cancelling them, elsewhere by aborting their
    engine requests; the other processes find their batch cancelled within half a second (see
    EpisodeWorker._cancelled_loop), and no result of theirs is stored."""
    cancellation = await cancel_batch(services.database, batch_id)
    if cancellation is None:
        raise NotFound(f"no batch {batch_id!r}")
    running = dict(cancellation.running)
    here = services.worker.cancel(running) if services.worker is not None else set()
    limit = asyncio.Semaphore(CANCEL_ABORTS_AT_ONCE)

    async def abort(episode_id: str) -> None:
        async with limit:
            await services.engine.abort(attempt_rid_prefix(episode_id, running[episode_id]))

    await asyncio.gather(*(abort(episode_id) for episode_id in running.keys() - here))
    services.endings.batch_cancelled(batch_id, cancellation.queued, len(running))
    return CancelOut(
        batch_id=batch_id, cancelled=cancellation.queued + len(running), counts=cancellation.counts
    )


async def _complete(services: Services, batch_id: str) -> bool:
    return await batch_finished(services.database, batch_id)


async def _summary(services: Services, batch_id: str) -> bytes | None:
    """The batch's JSON summary (None: no such batch). Its complete groups never change, so it
    needs no snapshot; their summaries come from `services.summaries` when polled before."""
    rows = await open_batch_rows(services.database, batch_id, snapshot=False)
    if rows is None:
        return None
    try:
        counts = rows.head.counts
        unfinished = sum(counts[status] for status in counts if status not in FINISHED_STATUSES)
        waiting = await services.engine.status.check() if unfinished else None
        return await batch_summary_json(rows, services.summaries, waiting)
    finally:
        await rows.aclose()
