"""A policy for the simulated SGLang worker that plays the help desk perfectly:
`python -m service sim-worker --policy helpdesk_env.oracle:reply`.

A sim policy is a function (prompt text, episode key) -> the assistant's next text. The prompt is
ChatML (`<|im_start|>role\\n...<|im_end|>`); a tool call is written as the served model writes it
(`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` for the test tokenizer's Hermes format).
"""

from __future__ import annotations

import json

from helpdesk_env.desk import SPLIT_SIZES, Task, tasks

IM_START, IM_END = "<|im_start|>", "<|im_end|>"


def _messages(prompt: str) -> list[tuple[str, str]]:
    messages = []
    for block in prompt.split(IM_START)[1:]:
        role, _, rest = block.partition("\n")
        messages.append((role.strip(), rest.split(IM_END)[0]))
    return messages


def _task(request: str) -> Task | None:
    for split in SPLIT_SIZES:
        for task in tasks(split):
            if task.request == request:
                return task
    return None


def reply(prompt: str, key: str) -> str:
    messages = _messages(prompt)
    first_user = next((content for role, content in messages if role == "user"), "")
    task = _task(first_user)
    done = sum(1 for role, _ in messages[:-1] if role == "assistant")  # the last is the open turn
    if task is None or done >= len(task.actions):
        return "All done: your request has been handled."
    action = task.actions[done]
    return f"<tool_call>\n{json.dumps({'name': action.name, 'arguments': action.kwargs})}\n</tool_call>"
