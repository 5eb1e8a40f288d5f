"""A protocol-level engine double for runner tests: fixed replies, answered as SGLang would."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from service.engine.client import Generation
from tests.support.tokenizer import chat_tokenizer


def tool_call(name: str, **arguments: Any) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


@dataclass
class FixedReplies:
    """Answers each generate call with the next reply, as SGLang would (ids, logprobs, stop)."""

    replies: list[str]
    rids: list[str] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: dict[str, Any],
        rid: str,
        *,
        input_ids_json: str | None = None,
    ) -> Generation:
        chat = chat_tokenizer()
        ids = [*chat.encode(self.replies[len(self.rids)]), chat.close_ids[0]]
        self.rids.append(rid)
        finish = {"type": "stop", "matched": chat.close_ids[0]}
        return Generation(ids, [-0.1] * len(ids), "stop", finish, "v1", len(input_ids), 0, "")

    async def abort(self, rid: str) -> None:
        self.aborted.append(rid)
