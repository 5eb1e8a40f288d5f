"""The episode runner's env opener with remote envs: an episode of a REMOTE_ENVS env opens a
session on a server of its pool, here on the event loop; every other env opens in the env workers
(EnvHost). The clients (openenv-core, mcp: the `remote` extra) are imported only where a remote env
of theirs is configured; NeMo Gym envs need none (plain HTTP)."""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

import httpx
from prometheus_client import CollectorRegistry

from service.envs.remote.config import RemoteEnvConfig
from service.envs.remote.nemo_gym import NemoGymEnv
from service.envs.remote.pool import PoolMetrics, ServerPool


class EnvOpener(Protocol):
    """What the episode runner opens sessions with (loop/runner.py's EnvOpener): EnvHost."""

    async def open(self, env_name: str, split: str, episode_key: str) -> Any: ...


class RemoteEnvs:
    """An EnvOpener: REMOTE_ENVS envs on their servers, the rest on `local` (the EnvHost)."""

    def __init__(
        self, configs: list[RemoteEnvConfig], local: EnvOpener, registry: CollectorRegistry | None = None
    ) -> None:
        self.local = local
        self.configs = {config.name: config for config in configs}
        self.metrics = PoolMetrics(registry)
        self._http = httpx.AsyncClient(timeout=5.0)  # OpenEnv's /schema requests and health checks
        self._open: set[Any] = set()
        self.openenv: dict[str, Any] = {}
        self.mcp: dict[str, Any] = {}
        self.nemo_gym: dict[str, NemoGymEnv] = {}
        for config in configs:
            if config.protocol == "openenv":
                require_extra("openenv")
                from service.envs.remote.openenv import OpenEnvEnv

                self.openenv[config.name] = OpenEnvEnv(config, self.metrics, self._http)
            elif config.protocol == "mcp":
                require_extra("mcp")
                from service.envs.remote.mcp_tools import McpEnv

                self.mcp[config.name] = McpEnv(config, self.metrics)
            elif config.protocol == "nemo_gym":
                self.nemo_gym[config.name] = NemoGymEnv(config, self.metrics)
        # Each env owns its pool of servers (and closes it): here for /ready's and the tests' view.
        every = {**self.openenv, **self.mcp, **self.nemo_gym}
        self.envs = {name: every[name] for name in self.configs}  # in REMOTE_ENVS' order
        self.pools: dict[str, ServerPool] = {name: env.pool for name, env in self.envs.items()}

    async def open(self, env_name: str, split: str, episode_key: str) -> Any:
        config = self.configs.get(env_name)
        if config is None:
            return await self.local.open(env_name, split, episode_key)
        if config.protocol == "mcp":
            return await self.mcp[env_name].open(split, episode_key)
        if config.protocol == "nemo_gym":
            return self.nemo_gym[env_name].session(split, episode_key)
        return LazySession(self, config, split, episode_key)

    def servers(self) -> dict[str, str]:
        """Each server's state, for /ready: "ok" or "down: why"."""
        return {
            f"{name} {server.url}": server.describe()
            for name, pool in self.pools.items()
            for server in pool.servers
        }

    async def close(self) -> None:
        """Closes sessions still open (shutdown) and stops the health checks."""
        await asyncio.gather(*(session.close() for session in list(self._open)), return_exceptions=True)
        await asyncio.gather(*(env.close() for env in self.envs.values()), return_exceptions=True)
        await self._http.aclose()


def require_extra(protocol: str) -> None:
    """Imports the client of `protocol` now, at start: a service configured with an env it cannot
    reach does not start, saying what to install."""
    try:
        if protocol == "openenv":
            from service.envs.remote import openenv  # noqa: F401
        else:
            from service.envs.remote import mcp_tools  # noqa: F401
    except ImportError as error:
        raise RuntimeError(
            f"REMOTE_ENVS names {protocol} envs but their client is not installed ({error}): "
            'pip install "rollout-service[remote]"'
        ) from error


class LazySession:
    """An OpenEnv episode's session: the runner opens it, then resets it with the task; the server
    session is made at the reset (OpenEnv resets and opens in one placement, so that a reset that
    did not take effect is retried on another server)."""

    def __init__(self, envs: RemoteEnvs, config: RemoteEnvConfig, split: str, episode_key: str) -> None:
        self.envs = envs
        self.config = config
        self.split = split
        self.episode_key = episode_key
        self.system_prompt = config.system_prompt
        self.tools: list[dict[str, Any]] = []
        self.session: Any = None  # an openenv.OpenEnvSession once reset

    async def reset(self, task_index: int) -> Any:
        self.envs._open.add(self)
        env = self.envs.openenv[self.config.name]
        self.session = await env.open(self.split, task_index, self.episode_key)
        self.tools = self.session.tools
        return await self.session.reset(task_index)

    async def step(self, action: Any) -> Any:
        assert self.session is not None, "a session is reset before its steps"
        return await self.session.step(action)

    async def close(self) -> None:
        self.envs._open.discard(self)
        if self.session is not None:
            await self.session.close()
