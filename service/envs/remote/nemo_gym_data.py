"""NeMo Gym datasets: a split is a JSONL file of rows, each a task as nemo-gym's agents send it to
/seed_session and /verify (`responses_create_params`, the policy's input and tools, beside the
fields the server's verifier reads). A row is read from disk when its episode starts; only the
lines' offsets stay in memory."""

from __future__ import annotations

import json
from array import array
from typing import Any


class DatasetRows:
    """One split's JSONL file; its rows are its non-blank lines, in order (the task index)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._starts = array("q")
        self._ends = array("q")
        try:
            with open(path, "rb") as file:
                position = 0
                for line in file:
                    if line.strip():
                        self._starts.append(position)
                        self._ends.append(position + len(line))
                    position += len(line)
        except OSError as error:
            raise ValueError(f"NeMo Gym dataset {path!r} cannot be read: {error}") from error

    def __len__(self) -> int:
        return len(self._starts)

    def row(self, index: int) -> dict[str, Any]:
        """Row `index`; ValueError naming the file and the row if it is not a NeMo Gym row."""
        start = self._starts[index]
        with open(self.path, "rb") as file:
            file.seek(start)
            line = file.read(self._ends[index] - start)
        try:
            row = json.loads(line)
        except ValueError as error:
            raise ValueError(f"{self.path} row {index} is not JSON: {error}") from error
        if not isinstance(row, dict) or not isinstance(row.get("responses_create_params"), dict):
            raise ValueError(f"{self.path} row {index} has no responses_create_params object")
        return row


def dataset_splits(datasets: dict[str, str]) -> dict[str, int]:
    """Split -> number of rows of each split's file."""
    return {split: len(DatasetRows(path)) for split, path in datasets.items()}


def policy_view(row: dict[str, Any]) -> tuple[str, str, list[dict[str, Any]]]:
    """(system prompt, first user turn, tools as OpenAI function schemas) of a row's
    responses_create_params: its `instructions` and system/developer messages, its user messages,
    its function tools. ValueError for what a single-prompt episode cannot show (an assistant
    turn, a tool that is not a function)."""
    params = row["responses_create_params"]
    system: list[str] = [params["instructions"]] if params.get("instructions") else []
    user: list[str] = []
    items = params.get("input", "")
    for item in [{"role": "user", "content": items}] if isinstance(items, str) else items:
        role = item.get("role") if isinstance(item, dict) else None
        if role in ("system", "developer"):
            system.append(content_text(item["content"]))
        elif role == "user":
            user.append(content_text(item["content"]))
        else:
            raise ValueError(
                f"input item {item!r:.200} is not a system, developer or user message: the episode's "
                "prompt is one system message and one user turn"
            )
    tools = []
    for tool in params.get("tools") or []:
        if tool.get("type") != "function":
            raise ValueError(f"tool {tool!r:.200} is not a function tool")
        tools.append(
            {
                "type": "function",
                "function": {
                    "name": tool["name"],
                    "description": tool.get("description") or "",
                    "parameters": tool.get("parameters") or {"type": "object", "properties": {}},
                },
            }
        )
    return "\n\n".join(system), "\n\n".join(user), tools


def content_text(content: Any) -> str:
    """A Responses message's content (a string, or text parts) as text."""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text"):
            raise ValueError(f"content part {part!r:.200} is not text (images and files are not shown)")
        texts.append(str(part.get("text", "")))
    return "".join(texts)
