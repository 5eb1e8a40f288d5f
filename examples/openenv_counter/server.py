"""An example OpenEnv environment server (docker/compose.yaml's `env-server` profile), also the
real server of the remote-env tests and bench: openenv-core's own server code (HTTPEnvServer,
MCPEnvironment, FastMCP tools) around a small environment:

- `counter` (the default): an MCP tool env. Reset with a task sets a target (task_index + 2); the
  tool `add(n)` adds to a counter and answers it; `submit(answer)` ends the episode, reward 1.0 if
  the answer is the target, else 0.0. `slow(seconds)` sleeps, for timeouts.
- `guess` (`--env guess`): a plain action env, no MCP tools: its action is `{"guess": n}`; the
  observation says higher, lower or right; right ends the episode with reward 1.0. The target is
  task_index + 2.

Run one: `python examples/openenv_counter/server.py --port 8123 [--max-sessions 64] [--env guess]`
(needs openenv-core: the service's `remote` extra, or `pip install openenv-core`). Besides the
OpenEnv routes it serves GET /test/sessions: {"active": sessions open now, "opened": ever}, and
GET /test/handler_ms: the milliseconds its WebSocket handler took per message (from a message's
receipt to its answer's send), the newest last; `?clear=true` empties the list after reading it.
"""

# ruff: noqa: E402 (the imports below come after the line that keeps openenv-core from importing gradio)
from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections import deque
from typing import Any

# openenv-core imports its web interface (gradio: half this server's start-up, 2 of 4 s of CPU) unless
# gradio cannot be imported, which it allows for (ModuleNotFoundError); this server serves no web UI.
sys.modules.setdefault("gradio", None)  # type: ignore[arg-type]

import uvicorn
from fastapi import FastAPI
from fastmcp import FastMCP
from openenv.core.env_server import (
    CallToolAction,
    CallToolObservation,
    Environment,
    HTTPEnvServer,
    MCPEnvironment,
)
from openenv.core.env_server.types import Action, ConcurrencyConfig, Observation, State
from pydantic import Field
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class TaskObservation(Observation):
    prompt: str = ""


OPENED = {"count": 0}
HANDLER_MS: deque[float] = deque(maxlen=100_000)


class CounterEnv(MCPEnvironment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        mcp = FastMCP("counter")
        self.counter = 0
        self.target = 0
        self.steps = 0
        self.episode_id: str | None = None

        @mcp.tool
        def add(n: int) -> int:
            """Add n to the counter; answers the counter."""
            self.counter += n
            return self.counter

        @mcp.tool
        def submit(answer: str) -> str:
            """Submit the final answer (ends the episode)."""
            return "right" if answer.strip() == str(self.target) else "wrong"

        @mcp.tool
        def slow(seconds: float) -> str:
            """Sleep that long, then answer."""
            time.sleep(seconds)
            return "slept"

        super().__init__(mcp)
        OPENED["count"] += 1

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, task_index: int = 0, **kwargs: Any
    ) -> TaskObservation:
        self.counter, self.steps, self.episode_id = 0, 0, episode_id
        self.target = task_index + 2
        return TaskObservation(prompt=f"Reach {self.target} with add, then submit it.")

    async def step_async(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        observation = await super().step_async(action, timeout_s=timeout_s, **kwargs)
        if isinstance(action, CallToolAction) and isinstance(observation, CallToolObservation):
            self.steps += 1
            if action.tool_name == "submit":
                observation.done = True
                observation.reward = (
                    1.0 if str(action.arguments.get("answer")).strip() == str(self.target) else 0.0
                )
            else:
                observation.reward = 0.0
        return observation

    def _step_impl(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return Observation(done=False, reward=0.0)

    @property
    def state(self) -> State:
        return State(episode_id=self.episode_id, step_count=self.steps)


class GuessAction(Action):
    """Guess the hidden number."""

    guess: int = Field(description="Your guess.")


class GuessObservation(Observation):
    message: str = ""


class GuessEnv(Environment):  # type: ignore[type-arg]
    """A plain reset/step env: no MCP tools, its own action type."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self.target = 0
        self.steps = 0
        self.episode_id: str | None = None
        OPENED["count"] += 1

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, task_index: int = 0, **kwargs: Any
    ) -> GuessObservation:
        self.target, self.steps, self.episode_id = task_index + 2, 0, episode_id
        return GuessObservation(message=f"Guess the number between 1 and {2 * self.target}.")

    def step(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:
        assert isinstance(action, GuessAction)
        self.steps += 1
        if action.guess == self.target:
            return GuessObservation(message="right", done=True, reward=1.0)
        return GuessObservation(message="higher" if action.guess < self.target else "lower", reward=0.0)

    @property
    def state(self) -> State:
        return State(episode_id=self.episode_id, step_count=self.steps)


class HandlerTimes:
    """ASGI middleware: how long the server takes per WebSocket message, from the message's
    receipt to its answer's send (the server's own handler time, which a client's round trip
    exceeds by the transport and the client's work)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "websocket":
            await self.app(scope, receive, send)
            return
        started: float | None = None

        async def timed_receive() -> Message:
            nonlocal started
            message = await receive()
            if message["type"] == "websocket.receive":
                started = time.perf_counter()
            return message

        async def timed_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "websocket.send" and started is not None:
                HANDLER_MS.append(1000 * (time.perf_counter() - started))
                started = None
            await send(message)

        await self.app(scope, timed_receive, timed_send)


ENVS: dict[str, tuple[Any, Any, Any]] = {
    "counter": (CounterEnv, CallToolAction, CallToolObservation),
    "guess": (GuessEnv, GuessAction, GuessObservation),
}


def create_counter_app(
    max_sessions: int = 64, session_timeout: float | None = 30.0, env: str = "counter"
) -> FastAPI:
    app = FastAPI(title=f"{env} env (OpenEnv)")
    env_cls, action_cls, observation_cls = ENVS[env]
    server = HTTPEnvServer(
        env_cls,
        action_cls,
        observation_cls,
        concurrency_config=ConcurrencyConfig(
            max_concurrent_envs=max_sessions, session_timeout=session_timeout
        ),
    )
    server.register_routes(app)
    app.add_middleware(HandlerTimes)

    @app.get("/test/sessions")
    async def sessions() -> dict[str, int]:
        return {"active": server.active_sessions, "opened": OPENED["count"]}

    @app.get("/test/handler_ms")
    async def handler_ms(clear: bool = False) -> list[float]:
        times = list(HANDLER_MS)
        if clear:
            HANDLER_MS.clear()
        return times

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1", help="0.0.0.0 in a container")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--max-sessions", type=int, default=64)
    parser.add_argument("--env", choices=sorted(ENVS), default="counter")
    args = parser.parse_args()
    config = uvicorn.Config(
        create_counter_app(args.max_sessions, env=args.env),
        host=args.host,
        port=args.port,
        log_level="warning",
        ws_max_queue=64,
    )
    asyncio.run(uvicorn.Server(config).serve())


if __name__ == "__main__":
    main()
