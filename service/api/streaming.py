"""A batch streamed a chunk of episodes at a time from one read snapshot, as Arrow (GET /batches/{id}
and GET /groups with Accept: application/vnd.apache.arrow.stream) or as JSON with token arrays."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

import pyarrow as pa
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from service.api.arrow import (
    ARROW_SCHEMA_MESSAGE,
    ARROW_STREAM_END,
    ARROW_STREAM_MEDIA_TYPE,
    arrow_record_batch,
)
from service.api.batch_json import batch_json_head, episodes_with_tokens_json
from service.storage.batch_rows import BatchRows, EpisodeRows

SEND_BYTES = 1024 * 1024  # body pieces handed to the server: the socket drains one while the next waits
PREFETCH_CHUNKS = 2  # record batches encoded or being encoded ahead of the one being sent


class BatchStreamResponse(StreamingResponse):
    """A batch streamed from `rows`: `head`, then each chunk of episodes encoded by `encode` (joined
    by `separator`), then `tail`; in a pipeline: while one chunk is sent, the next ones are encoded
    (on threads: the event loop runs the episodes meanwhile) and read. Chunked, since its length is
    known only at the end, so an error once the status line went out can only cut the body short:
    the client sees it incomplete (no Arrow end marker, unterminated JSON).

    It owns `rows`: the read snapshot is closed however the response ends (sent, the client gone,
    an error)."""

    def __init__(
        self,
        rows: EpisodeRows,
        chunks: AsyncIterator[Any],
        encode: Callable[[Any], bytes | pa.Buffer],
        *,
        head: bytes,
        tail: bytes,
        separator: bytes = b"",
        media_type: str,
    ) -> None:
        self._rows = rows
        self._reader: asyncio.Task[None] | None = None
        self._stream = self._body(chunks, encode, head, tail, separator)
        super().__init__(self._stream, media_type=media_type)

    @staticmethod
    async def _read(
        chunks: AsyncIterator[Any],
        encode: Callable[[Any], bytes | pa.Buffer],
        encoded: asyncio.Queue[asyncio.Future[bytes | pa.Buffer] | None],
    ) -> None:
        try:
            async for chunk in chunks:
                await encoded.put(asyncio.ensure_future(asyncio.to_thread(encode, chunk)))
        except Exception as error:  # the database's: the body raises it where this chunk goes
            failed: asyncio.Future[bytes | pa.Buffer] = asyncio.get_running_loop().create_future()
            failed.set_exception(error)
            await encoded.put(failed)
        else:
            await encoded.put(None)

    async def _body(
        self,
        chunks: AsyncIterator[Any],
        encode: Callable[[Any], bytes | pa.Buffer],
        head: bytes,
        tail: bytes,
        separator: bytes,
    ) -> AsyncGenerator[bytes | memoryview]:
        encoded: asyncio.Queue[asyncio.Future[bytes | pa.Buffer] | None] = asyncio.Queue(PREFETCH_CHUNKS)
        self._reader = asyncio.create_task(self._read(chunks, encode, encoded))
        yield head
        first = True
        while (encoding := await encoded.get()) is not None:
            view = memoryview(await encoding)
            if not first and separator:
                yield separator
            first = False
            for start in range(0, len(view), SEND_BYTES):
                yield view[start : start + SEND_BYTES]
        yield tail

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # Here, past Starlette's task group, whose cancellation (the client went away) would
            # cancel these awaits too. The reader ends before its snapshot does.
            await self._stream.aclose()
            if self._reader is not None:
                self._reader.cancel()
                await asyncio.wait([self._reader])
            await self._rows.aclose()


def arrow_stream(rows: EpisodeRows) -> BatchStreamResponse:
    """The episodes as an Arrow IPC stream: the schema message, a record batch per chunk, the end marker."""
    return BatchStreamResponse(
        rows,
        rows.chunks(),
        arrow_record_batch,
        head=ARROW_SCHEMA_MESSAGE,
        tail=ARROW_STREAM_END,
        media_type=ARROW_STREAM_MEDIA_TYPE,
    )


def tokens_json_stream(rows: BatchRows) -> BatchStreamResponse:
    """The batch as JSON (BatchOut) with its episodes' token arrays (EpisodeWithTokens)."""
    head, tail = batch_json_head(rows.head)
    return BatchStreamResponse(
        rows,
        rows.chunks(),
        episodes_with_tokens_json,
        head=head,
        tail=tail,
        separator=b",",
        media_type="application/json",
    )
