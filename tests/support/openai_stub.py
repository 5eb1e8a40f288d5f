"""A scripted OpenAI-compatible /v1/chat/completions server, on an ephemeral port, for user-sim tests."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

# messages of the request -> the simulated user's next line, or its whole message (content, tool_calls)
Script = Callable[[list[dict[str, Any]]], str | dict[str, Any]]


@dataclass
class StubServer:
    base_url: str
    requests: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)


def _app(script: Script, server: StubServer) -> Starlette:
    async def chat_completions(request: Request) -> JSONResponse:
        body = await request.json()
        server.requests.append(body)
        server.headers.append(dict(request.headers))
        reply = script(body["messages"])
        message = (
            {"role": "assistant", "content": reply}
            if isinstance(reply, str)
            else {"role": "assistant", **reply}
        )
        return JSONResponse(
            {
                "id": f"chatcmpl-{len(server.requests)}",
                "object": "chat.completion",
                "model": body.get("model", ""),
                "choices": [
                    {
                        "index": 0,
                        "message": message,
                        "finish_reason": "tool_calls" if message.get("tool_calls") else "stop",
                    }
                ],
                "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
            }
        )

    return Starlette(routes=[Route("/v1/chat/completions", chat_completions, methods=["POST"])])


@contextmanager
def openai_stub(script: Script) -> Iterator[StubServer]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    stub = StubServer(base_url=f"http://127.0.0.1:{port}/v1")
    config = uvicorn.Config(_app(script, stub), log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("the OpenAI stub server did not start")
            time.sleep(0.01)
        yield stub
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def closed_port_url() -> str:
    """A base URL nothing listens on."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"
