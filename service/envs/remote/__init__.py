"""Environments that run elsewhere: OpenEnv servers, MCP tool servers and NeMo Gym resource servers,
registered by the REMOTE_ENVS setting (no code), each behind a pool of servers (docs/remote-envs.md)."""
