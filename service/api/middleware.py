"""ASGI middleware: API keys and request size limits, before any route runs."""

from __future__ import annotations

from fastapi import FastAPI, HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api.auth import bearer_key
from service.api.errors import PayloadTooLarge, ServiceError, Unauthorized, error_response
from service.config import KeyTable, Settings

# Probes and scrapes: a kubelet's probe and an annotation-discovered Prometheus scrape send no key.
# They tell whether the service is up and how many episodes it holds, nothing of any batch.
PUBLIC_PATHS = frozenset({"/health", "/ready", "/metrics"})
# Pages and what they load, none of it data: the viewer (which asks for a key and sends it to the
# JSON API) and the API docs with the contract they render (openapi.yaml is public anyway).
PUBLIC_PAGES = frozenset({"/", "/ui", "/docs", "/docs/oauth2-redirect", "/openapi.json"})
PUBLIC_PREFIXES = ("/ui/", "/docs/assets/")


# External agents' endpoints: each episode's own token opens it, checked by its routes
# (service/agents/deps.py), which take an API key too.
AGENT_PREFIX = "/v1/episodes/"


def is_public(path: str) -> bool:
    return (
        path in PUBLIC_PATHS
        or path in PUBLIC_PAGES
        or path.startswith(PUBLIC_PREFIXES)
        or path.startswith(AGENT_PREFIX)
    )


class BodyTooLarge(HTTPException):
    """Raised while a body without Content-Length streams in past the limit. An HTTPException,
    because FastAPI turns any other error raised while reading a body into a 400."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body larger than {limit} bytes")


class GuardMiddleware:
    """401 without a valid `Authorization: Bearer <key>` (when keys are set: API_KEYS, API_PROJECTS);
    413 past the size limit. What a valid key opens the routes judge (access.py)."""

    def __init__(self, app: ASGIApp, *, keys: KeyTable, max_body_bytes: int) -> None:
        self.app = app
        self.keys = keys
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if (
            not self.keys.open
            and not is_public(scope["path"])
            and self.keys.lookup(bearer_key(headers.get(b"authorization", b""))) is None
        ):
            await self._reject(
                Unauthorized("missing or invalid API key: send 'Authorization: Bearer <key>'"),
                scope,
                receive,
                send,
            )
            return
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await self._reject(self._too_large(), scope, receive, send)
            return
        await self.app(scope, self._limited(receive), send)

    def _too_large(self) -> PayloadTooLarge:
        return PayloadTooLarge(f"request body larger than {self.max_body_bytes} bytes")

    def _limited(self, receive: Receive) -> Receive:
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise BodyTooLarge(self.max_body_bytes)
            return message

        return limited_receive

    async def _reject(self, error: ServiceError, scope: Scope, receive: Receive, send: Send) -> None:
        await error_response(error)(scope, receive, send)


def install_middleware(app: FastAPI, settings: Settings) -> None:
    app.add_middleware(GuardMiddleware, keys=settings.key_table, max_body_bytes=settings.max_request_bytes)
