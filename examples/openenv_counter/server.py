"""An example OpenEnv environment server (docker/compose.yaml's `env-server` profile), also the
real server of the remote-env tests and bench: openenv-core's own server code (HTTPEnvServer,
MCPEnvironment, FastMCP tools) around a small environment:

- `counter`: an MCP tool env. Reset with a task sets a target (task_index + 2); the tool `add(n)`
  adds to a counter and answers it; `submit(answer)` ends the episode, reward 1.0 if the answer
  is the target, else 0.0. `slow(seconds)` sleeps, for timeouts.

Run one: `python examples/openenv_counter/server.py --port 8123 [--max-sessions 64]` (needs
openenv-core: the service's `remote` extra, or `pip install openenv-core`). Besides the
OpenEnv routes it serves GET /test/sessions: {"active": sessions open now, "opened": ever}.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastmcp import FastMCP
from openenv.core.env_server import CallToolAction, CallToolObservation, HTTPEnvServer, MCPEnvironment
from openenv.core.env_server.types import Action, ConcurrencyConfig, Observation, State


class TaskObservation(Observation):
    prompt: str = ""


OPENED = {"count": 0}


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


def create_counter_app(max_sessions: int = 64, session_timeout: float | None = 30.0) -> FastAPI:
    app = FastAPI(title="counter env (OpenEnv)")
    server = HTTPEnvServer(
        CounterEnv,
        CallToolAction,
        CallToolObservation,
        concurrency_config=ConcurrencyConfig(
            max_concurrent_envs=max_sessions, session_timeout=session_timeout
        ),
    )
    server.register_routes(app)

    @app.get("/test/sessions")
    async def sessions() -> dict[str, int]:
        return {"active": server.active_sessions, "opened": OPENED["count"]}

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1", help="0.0.0.0 in a container")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--max-sessions", type=int, default=64)
    args = parser.parse_args()
    config = uvicorn.Config(
        create_counter_app(args.max_sessions),
        host=args.host,
        port=args.port,
        log_level="warning",
        ws_max_queue=64,
    )
    asyncio.run(uvicorn.Server(config).serve())


if __name__ == "__main__":
    main()
