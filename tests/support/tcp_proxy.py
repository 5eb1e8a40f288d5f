"""A TCP forwarder in front of a real server that a test can cut and restore: a network outage of
the database as the service sees it (its connections reset, new ones refused), the server itself
untouched and shared with the rest of the suite."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

CHUNK_BYTES = 65536


class TcpProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = 0
        self.up = True
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._pipes: set[asyncio.Task[None]] = set()

    def cut(self) -> None:
        """Resets every open connection; new ones are closed on arrival until restore()."""
        self.up = False
        for writer in list(self._writers):
            with contextlib.suppress(Exception):
                writer.transport.abort()
        self._writers.clear()

    def restore(self) -> None:
        self.up = True

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.up:
            writer.transport.abort()
            return
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self._writers.update((writer, upstream_writer))
        for source, sink in ((reader, upstream_writer), (upstream_reader, writer)):
            pipe = asyncio.create_task(self._pipe(source, sink))
            self._pipes.add(pipe)
            pipe.add_done_callback(self._pipes.discard)

    async def _pipe(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        try:
            while data := await source.read(CHUNK_BYTES):
                sink.write(data)
                await sink.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            self._writers.discard(sink)
            sink.transport.abort()

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[TcpProxy]:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        try:
            yield self
        finally:
            self._server.close()
            self.cut()
            for pipe in list(self._pipes):
                pipe.cancel()
            await asyncio.gather(*self._pipes, return_exceptions=True)
