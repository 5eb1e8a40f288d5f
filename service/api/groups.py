"""GET /groups: complete groups of every batch, in the order they completed, for asynchronous
trainers that take groups as they finish rather than whole batches."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Response
from pydantic import StringConstraints

from service.api.access import AccessDep
from service.api.arrow import ARROW_STREAM_MEDIA_TYPE
from service.api.batch_json import groups_page_json
from service.api.deps import LONG_POLL_CUT, ServicesDep, long_poll
from service.api.errors import DatabaseUnavailable, responses
from service.api.schemas import BATCH_ID_PATTERN, INT32_MAX, GroupsOut
from service.api.streaming import arrow_stream
from service.api.values import Label
from service.app_state import Services
from service.storage import groups
from service.storage.batch_rows import open_group_rows
from service.storage.groups import GroupFilter, GroupPage

router = APIRouter(tags=["groups"])

MAX_GROUPS_PER_PAGE = 1000
MAX_BATCH_IDS = 256  # batch_id filters in one request
NEXT_CURSOR_HEADER = "Rollout-Next-Cursor"
FILTERED_HEADER = "Rollout-Groups-Filtered"


@router.get(
    "/groups",
    operation_id="get_groups",
    response_model=GroupsOut,
    responses={
        **responses(DatabaseUnavailable),
        200: {
            "description": "A page of complete groups as JSON, or with `Accept: "
            "application/vnd.apache.arrow.stream` their episodes as an Arrow IPC stream (one row per "
            f"episode, the schema of GET /batches/{{id}}), the page's `next` and `filtered` in the "
            f"`{NEXT_CURSOR_HEADER}` and `{FILTERED_HEADER}` headers.",
            "content": {ARROW_STREAM_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}},
            "headers": {
                NEXT_CURSOR_HEADER: {"description": "The page's `next`.", "schema": {"type": "integer"}},
                FILTERED_HEADER: {"description": "The page's `filtered`.", "schema": {"type": "integer"}},
            },
        },
    },
)
async def get_groups(
    services: ServicesDep,
    access: AccessDep,
    after: Annotated[
        int,
        Query(ge=0, le=INT32_MAX, description="Cursor: the groups after this one (0: from the first)."),
    ] = 0,
    limit: Annotated[int, Query(ge=1, le=MAX_GROUPS_PER_PAGE, description="Groups per page, at most.")] = 100,
    wait: Annotated[
        float,
        Query(
            ge=0,
            allow_inf_nan=False,
            description="Long-poll: seconds to wait for a group when none is there yet" + LONG_POLL_CUT,
        ),
    ] = 0,
    batch_id: Annotated[
        list[Annotated[str, StringConstraints(max_length=128, pattern=BATCH_ID_PATTERN)]] | None,
        Query(
            max_length=MAX_BATCH_IDS,
            description=f"Only these batches' groups (repeat it: `batch_id=a&batch_id=b`, at most "
            f"{MAX_BATCH_IDS}).",
        ),
    ] = None,
    env: Annotated[
        Label | None, Query(max_length=128, description="Only groups of this environment.")
    ] = None,
    min_reward_std: Annotated[
        float | None,
        Query(
            ge=0,
            allow_inf_nan=False,
            description="Only groups whose reward std is above this; the others are skipped and counted "
            "in `filtered`. 0 skips exactly the groups whose rewards are all equal (DAPO's dynamic "
            "sampling), and groups without rewards.",
        ),
    ] = None,
    accept: Annotated[str, Header()] = "application/json",
) -> Any:
    """Complete groups (every episode has a final status) past the cursor `after`, in the order they
    completed. The cursor lives in the database: it survives restarts and holds across service
    processes; following `next`, no group comes twice and none is skipped. A project key
    (API_PROJECTS) reads its project's groups only."""
    where = GroupFilter(
        batch_ids=tuple(batch_id) if batch_id else None,
        env=env,
        min_reward_std=min_reward_std,
        batch_prefix=access.batch_prefix,
    )
    page = await _next_page(services, after, limit, wait, where)
    services.metrics.groups_filtered.inc(page.filtered)
    rows = await open_group_rows(services.database, [(g.batch_id, g.group_index) for g in page.groups])
    if ARROW_STREAM_MEDIA_TYPE in accept:
        response: Response = arrow_stream(rows)  # it closes the rows
    else:
        try:
            episodes = await rows.summaries()
        finally:
            await rows.aclose()
        response = Response(groups_page_json(page, episodes), media_type="application/json")
    response.headers[NEXT_CURSOR_HEADER] = str(page.next)
    response.headers[FILTERED_HEADER] = str(page.filtered)
    return response


async def _next_page(
    services: Services, after: int, limit: int, wait: float, where: GroupFilter
) -> GroupPage:
    """The first page past `after` with a group in it, or, once `wait` is over, an empty one;
    `filtered` counts what every read skipped on the way."""
    cursor, filtered = after, 0
    page = GroupPage([], after, 0)

    async def found() -> bool:
        nonlocal cursor, filtered, page
        async with services.database.reader() as session:
            page = await groups.read_page(session, cursor, limit, where)
        cursor, filtered = page.next, filtered + page.filtered
        return bool(page.groups)

    await long_poll(services, wait, found)
    return GroupPage(page.groups, cursor, filtered)
