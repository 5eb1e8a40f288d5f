"""A real MCP tool server for the remote-env tests, built with the official `mcp` SDK (MCPServer):
a key-value notebook per connection. `python -m tests.support.mcp_server` speaks stdio;
`--port N` serves streamable HTTP at http://127.0.0.1:N/mcp. Its tasks and reward (McpTasks) are
`notebook_tasks` below: store the task's word under its key, then answer the word."""

from __future__ import annotations

import argparse
from typing import Any

from mcp.server.mcpserver import MCPServer

from service.envs.base import Reset

server = MCPServer("notebook")
NOTES: dict[str, str] = {}  # one server process per stdio episode; shared by HTTP sessions


@server.tool()
def write(key: str, value: str) -> str:
    """Store a value under a key."""
    NOTES[key] = value
    return f"stored {key}"


@server.tool()
def read(key: str) -> str:
    """The value stored under a key."""
    return NOTES.get(key, "nothing")


WORDS = ("apple", "river", "stone", "cloud")


class NotebookTasks:
    system_prompt = "Use the notebook tools, then answer."

    def task(self, split: str, task_index: int) -> Reset:
        word = WORDS[task_index % len(WORDS)]
        return Reset(
            observation=f"Store {word} under k{task_index}, then answer {word}.", info={"word": word}
        )

    def reward(self, split: str, task_index: int, calls: list[dict[str, Any]], answer: str) -> float:
        word = WORDS[task_index % len(WORDS)]
        stored = any(c["name"] == "write" and c["arguments"].get("value") == word for c in calls)
        return 1.0 if stored and answer.strip() == word else 0.0


def notebook_tasks() -> NotebookTasks:
    return NotebookTasks()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--max-sessions", type=int, default=64)  # accepted as the OpenEnv server's
    args = parser.parse_args()
    if args.port:
        server.run("streamable-http", host="127.0.0.1", port=args.port)
    else:
        server.run("stdio")


if __name__ == "__main__":
    main()
