"""Structured logs: one JSON object a line, carrying the episode a task runs."""

from __future__ import annotations

import asyncio
import json
import logging
import os

from service.logs import EPISODE_LOG_FIELDS, JsonFormatter


def record(message: str) -> logging.LogRecord:
    return logging.LogRecord("service.test", logging.WARNING, __file__, 1, message, None, None)


async def test_lines_logged_inside_an_episode_task_carry_its_ids() -> None:
    formatter = JsonFormatter()

    async def episode(episode_id: str) -> dict[str, object]:
        EPISODE_LOG_FIELDS.set({"episode_id": episode_id, "attempt": 1})
        await asyncio.sleep(0)  # another episode task runs in between
        line: dict[str, object] = json.loads(formatter.format(record("engine retry")))
        return line

    first, second = await asyncio.gather(episode("ep-a"), episode("ep-b"))
    assert (first["episode_id"], second["episode_id"]) == ("ep-a", "ep-b")
    assert first["message"] == "engine retry" and first["level"] == "WARNING" and first["attempt"] == 1
    outside = json.loads(formatter.format(record("worker started")))
    assert "episode_id" not in outside  # the tasks' context did not leak into this one
    assert outside["pid"] == os.getpid()  # lines of `serve --workers N` processes tell them apart
