"""Environments that run elsewhere: OpenEnv servers and MCP tool servers, registered by the
REMOTE_ENVS setting (no code), each behind a pool of servers (docs/remote-envs.md)."""
