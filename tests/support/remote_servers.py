"""Real env servers in child processes, for the remote-env tests and bench: the example OpenEnv
server (examples/openenv_counter/server.py), the MCP server of tests/support/mcp_server.py or the
NeMo Gym resource server of tests/support/nemo_gym_server.py, started on free ports, waited for,
killed at the end."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.support.ports import free_port

START_TIMEOUT_SECONDS = 600.0  # a loaded shared machine imports openenv-core (gradio too) slowly
# A killed server reaped: 10 s was outrun in CI (TimeoutExpired at a module's teardown, load 6-10), which
# also left the pair's other server running (a ResourceWarning failing the next test on that worker).
KILL_WAIT_SECONDS = 60.0
OPENENV_SERVER = [
    sys.executable,
    str(Path(__file__).resolve().parents[2] / "examples/openenv_counter/server.py"),
]
GUESS_SERVER = (*OPENENV_SERVER, "--env", "guess")  # the example's plain action env (no MCP tools)
MCP_SERVER = [sys.executable, "-m", "tests.support.mcp_server"]


@dataclass
class EnvServer:
    url: str
    process: subprocess.Popen[bytes]

    def sessions(self) -> dict[str, int]:
        """{"active": sessions open now, "opened": ever} as the server counts them."""
        return dict(httpx.get(f"{self.url}/test/sessions", timeout=60).json())

    def handler_ms(self, clear: bool = False) -> list[float]:
        """The server's own handler time per WebSocket message (the example server's middleware)."""
        return list(httpx.get(f"{self.url}/test/handler_ms", params={"clear": clear}, timeout=60).json())

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(KILL_WAIT_SECONDS)


def launch_server(
    max_sessions: int | None = 64, command: tuple[str, ...] = tuple(OPENENV_SERVER)
) -> EnvServer:
    """The server `command` runs on a free port (with `--max-sessions` unless None), started."""
    port = free_port()
    cap = [] if max_sessions is None else ["--max-sessions", str(max_sessions)]
    process = subprocess.Popen(
        [*command, "--port", str(port), *cap],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return EnvServer(f"http://127.0.0.1:{port}", process)


def wait_listening(server: EnvServer, health: str = "/health") -> None:
    """Returns once `health` answers (any HTTP status); kills the server if it does not in time."""
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(
                f"{server.process.args} exited with {server.process.returncode} before it listened"
            )
        try:
            httpx.get(f"{server.url}{health}", timeout=1)
            return
        except httpx.HTTPError:
            time.sleep(0.1)
    server.kill()
    raise RuntimeError(f"{server.process.args} did not answer {health} within {START_TIMEOUT_SECONDS:g} s")


@contextmanager
def listening(servers: list[EnvServer], health: str = "/health") -> Iterator[list[EnvServer]]:
    """`servers`, launched side by side (each imports its libraries at once), once all answer
    `health`; killed at the end."""
    try:
        for server in servers:
            wait_listening(server, health)
        yield servers
    finally:
        for server in servers:  # all killed before any is waited for: none left running if one is slow
            if server.process.poll() is None:
                server.process.kill()
        for server in servers:
            server.process.wait(KILL_WAIT_SECONDS)


def env_servers(
    count: int,
    max_sessions: int | None = 64,
    command: tuple[str, ...] = tuple(OPENENV_SERVER),
    health: str = "/health",
) -> AbstractContextManager[list[EnvServer]]:
    """`count` servers of `command`, started side by side, once all listen (`listening`)."""
    servers: list[EnvServer] = []
    try:
        for _ in range(count):
            servers.append(launch_server(max_sessions, command))
    except BaseException:
        for server in servers:
            server.kill()
        raise
    return listening(servers, health)


@dataclass(frozen=True)
class OpenEnvServers:
    """The example's OpenEnv servers the remote-env tests share (tests/conftest.py's openenv_servers)."""

    counters: list[EnvServer]  # two of its MCP counter env
    guess: EnvServer  # its plain action env
