"""A NeMo Gym resource server built with nemo-gym's own server code (SimpleResourcesServer, its session
middleware, liveness and exception middleware, BaseVerifyRequest/Response and the Responses types
/verify validates; nemo-gym 0.4.0, NVIDIA-NeMo/Gym d67ad6611cfe), for tests/test_remote_envs_nemo_gym.py.
It runs in nemo-gym's cached virtualenv (scripts/ensure_nemo_gym.sh), never imported by the suite.

A counter per session (its cookie): `add(n)` adds n, `read()` tells the count, `slow(seconds)`
sleeps. /verify gives 1.0 when the session's count is the row's `target` and the final answer says
it, else 0.0. GET /test/stats tells the seeds, verifies and tool calls it served.

Usage: python nemo_gym_server.py --port PORT
"""

from __future__ import annotations

import argparse
import asyncio

import uvicorn
from fastapi import FastAPI, Request
from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseSeedSessionRequest,
    BaseSeedSessionResponse,
    BaseVerifyRequest,
    BaseVerifyResponse,
    SimpleResourcesServer,
)
from nemo_gym.config_types import BaseServerConfig
from nemo_gym.server_utils import SESSION_ID_KEY, ServerClient
from omegaconf import OmegaConf
from pydantic import BaseModel, Field


class CounterSeedRequest(BaseSeedSessionRequest):
    start: int = 0


class AddRequest(BaseModel):
    n: int


class SlowRequest(BaseModel):
    seconds: float


class CountResponse(BaseModel):
    count: int


class CounterVerifyRequest(BaseVerifyRequest):
    target: int


class CounterServer(SimpleResourcesServer):
    config: BaseResourcesServerConfig
    counts: dict[str, int] = Field(default_factory=dict)
    stats: dict[str, int] = Field(default_factory=lambda: {"seeds": 0, "verifies": 0, "calls": 0})

    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()
        app.post("/add")(self.add)
        app.post("/read")(self.read)
        app.post("/slow")(self.slow)
        app.get("/test/stats")(self.test_stats)
        return app

    async def seed_session(self, request: Request, body: CounterSeedRequest) -> BaseSeedSessionResponse:
        self.stats["seeds"] += 1
        self.counts[request.session[SESSION_ID_KEY]] = body.start
        return BaseSeedSessionResponse()

    async def add(self, request: Request, body: AddRequest) -> CountResponse:
        self.stats["calls"] += 1
        session = request.session[SESSION_ID_KEY]
        self.counts[session] = self.counts.get(session, 0) + body.n
        return CountResponse(count=self.counts[session])

    async def read(self, request: Request) -> CountResponse:
        self.stats["calls"] += 1
        return CountResponse(count=self.counts.get(request.session[SESSION_ID_KEY], 0))

    async def slow(self, body: SlowRequest) -> CountResponse:
        self.stats["calls"] += 1
        await asyncio.sleep(body.seconds)
        return CountResponse(count=0)

    async def verify(self, request: Request, body: CounterVerifyRequest) -> BaseVerifyResponse:
        self.stats["verifies"] += 1
        count = self.counts.get(request.session[SESSION_ID_KEY])
        answered = body.response.output_text.strip() == str(body.target)
        return BaseVerifyResponse(**body.model_dump(), reward=float(count == body.target and answered))

    async def test_stats(self) -> dict[str, int]:
        return {**self.stats, "sessions": len(self.counts)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    port = parser.parse_args().port
    # What nemo-gym's run_webserver does, less the Ray cluster and the head server it would reach:
    # this server calls no other.
    config = BaseResourcesServerConfig(host="127.0.0.1", port=port, entrypoint="", name="counter")
    head = BaseServerConfig(host="127.0.0.1", port=0)
    client = ServerClient(head_server_config=head, global_config_dict=OmegaConf.create({}))
    server = CounterServer(config=config, server_client=client)
    app = server.setup_webserver()
    server.setup_liveness(app)
    server.setup_exception_middleware(app)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", timeout_graceful_shutdown=0.5)


if __name__ == "__main__":
    main()
