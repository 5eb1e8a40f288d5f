"""Serving: the service in this process until SIGTERM (`serve`), and an app on a free loopback port
inside a running event loop (demo, tests, benchmarks)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import FrameType

import uvicorn
from starlette.types import ASGIApp

from service.app import create_app
from service.config import Settings
from service.sockets import listen

STARTUP_TIMEOUT_SECONDS = 60.0


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


@asynccontextmanager
async def serve_app(app: ASGIApp, host: str = "127.0.0.1") -> AsyncIterator[str]:
    """Runs `app` (lifespan included) with uvicorn on a free port; yields its base URL."""
    sock = listen(host, 0)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", log_config=None, ws="none"))
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
