"""The JSON summaries of batches' complete groups, kept to answer the next poll."""

from __future__ import annotations

from collections import OrderedDict

GROUP_SUMMARIES_BYTES = 64 * 1024 * 1024  # JSON of complete groups kept for polls, all batches


class GroupSummaries:
    """The JSON summaries of batches' complete groups, kept to answer the next poll: a group, once
    complete, never changes (each of its episodes' final result is written once), so the polls of a
    running batch encode each group once. The least recently polled batches go past `max_bytes`."""

    def __init__(self, max_bytes: int = GROUP_SUMMARIES_BYTES) -> None:
        self.max_bytes = max_bytes
        self._batches: OrderedDict[str, dict[int, bytes]] = OrderedDict()
        self._bytes = 0

    def of(self, batch_id: str) -> dict[int, bytes]:
        """The batch's groups summarized so far (a copy, by group index)."""
        groups = self._batches.get(batch_id)
        if groups is None:
            return {}
        self._batches.move_to_end(batch_id)
        return dict(groups)

    def add(self, batch_id: str, groups: dict[int, bytes]) -> None:
        kept = self._batches.setdefault(batch_id, {})
        self._bytes += sum(len(text) - len(kept.get(group, b"")) for group, text in groups.items())
        kept.update(groups)
        self._batches.move_to_end(batch_id)
        while self._bytes > self.max_bytes and len(self._batches) > 1:
            _, dropped = self._batches.popitem(last=False)
            self._bytes -= sum(len(text) for text in dropped.values())
