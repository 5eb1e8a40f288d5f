"""Serving: the service in this process until SIGTERM (`serve`), and an app on a free loopback port
inside a running event loop (demo, tests, benchmarks)."""

from __future__ import annotations

import asyncio
import contextvars
import gc
import itertools
import logging
import os
import signal
import socket
import tracemalloc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import FrameType

import uvicorn
from starlette.types import ASGIApp

from service.app import create_app
from service.config import Settings
from service.sockets import listen

STARTUP_TIMEOUT_SECONDS = 60.0
TRACEMALLOC_FRAMES = 10  # frames a trace keeps (PYTHONTRACEMALLOC=N: N, from the interpreter's start)

logger = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    """A uvicorn server that tells the app when it is asked to exit, before it waits for open
    connections (a trainer's long-poll) to close."""

    def __init__(self, config: uvicorn.Config, shutting_down: asyncio.Event) -> None:
        super().__init__(config)
        self.shutting_down = shutting_down

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        self.shutting_down.set()


def run_service(
    settings: Settings, host: str = "127.0.0.1", port: int = 8000, sockets: list[socket.socket] | None = None
) -> None:
    """The whole service (API and worker) in this process until SIGTERM or SIGINT, then drained:
    long-polls end, in-flight episodes get SHUTDOWN_TIMEOUT_SECONDS, the rest go back to the queue.
    It listens on `sockets` when given (a socket shared by `serve --workers`), else on host:port."""
    if settings.tracemalloc_dir is not None:
        snapshot_on_signal(settings.tracemalloc_dir)
    shutting_down = asyncio.Event()
    config = uvicorn.Config(
        create_app(settings, shutting_down),
        host=host,
        port=port,
        log_config=None,
        ws="none",
        timeout_keep_alive=settings.http_keep_alive_seconds,
        # A backstop: connections still open this long after SIGTERM are closed.
        timeout_graceful_shutdown=max(1, int(settings.shutdown_timeout_seconds)),
    )
    DrainingServer(config, shutting_down).run(sockets=sockets)


def snapshot_on_signal(directory: Path) -> None:
    """SIGUSR2 starts tracing this process's Python allocations (tracemalloc), and each SIGUSR2 after
    it writes a snapshot to `directory` (TRACEMALLOC_DIR); two snapshots' diff names the lines whose
    memory grew (bench/soak.py --tracemalloc). Nothing is traced before the first signal: tracing
    slows every allocation (start-up's imports took minutes under it, not seconds). A snapshot is
    taken in the handler, between two bytecodes of the event loop's thread, which it stops for
    seconds on a large heap."""
    directory.mkdir(parents=True, exist_ok=True)
    numbers = itertools.count(1)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        # In a context of its own: not logged as a line of the episode it interrupted.
        contextvars.Context().run(write_snapshot)

    def write_snapshot() -> None:
        if not tracemalloc.is_tracing():
            tracemalloc.start(TRACEMALLOC_FRAMES)
            logger.warning("tracemalloc started: the next SIGUSR2 writes a snapshot to %s", directory)
            return
        path = directory / f"tracemalloc-{os.getpid()}-{next(numbers):03d}.pickle"
        tracemalloc.take_snapshot().dump(str(path))
        traced, peak = tracemalloc.get_traced_memory()
        collections = [generation["collections"] for generation in gc.get_stats()]
        logger.warning(
            "tracemalloc snapshot %s: %d bytes traced (peak %d); garbage collections by generation: %s",
            path, traced, peak, collections,
        )  # fmt: skip

    signal.signal(signal.SIGUSR2, on_signal)


@asynccontextmanager
async def serve_app(app: ASGIApp, host: str = "127.0.0.1") -> AsyncIterator[str]:
    """Runs `app` (lifespan included) with uvicorn on a free port; yields its base URL."""
    sock = listen(host, 0)
    port = sock.getsockname()[1]
    # The tests' clients (httpx, 5 s) reuse connections as run_service's do: the same keep-alive.
    keep_alive = Settings.model_fields["http_keep_alive_seconds"].default
    config = uvicorn.Config(
        app, log_level="warning", log_config=None, ws="none", timeout_keep_alive=keep_alive
    )
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        async with asyncio.timeout(STARTUP_TIMEOUT_SECONDS):
            while not server.started:
                if serving.done():
                    serving.result()  # raises what stopped the server
                    raise RuntimeError("the server stopped during startup")
                await asyncio.sleep(0.02)
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        await serving
        sock.close()
