"""One simulated worker's prefix cache, as SGLang's radix cache serves a prompt: the longest cached
prefix is not computed again and is reported as `meta_info.cached_tokens`.

Token sequences are cached in pages of `page_tokens`; a page is known by the hash of everything up
to its end, so a page matches only after the same prefix, and each page remembers the sequence it
came from, so a match is exact to the token (SGLang's default page size is 1). Pages are evicted
least recently used first once more than `capacity_tokens` are held (SGLang's max_total_num_tokens).
A request's page keys are hashed once: match() returns them for insert() to extend.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence

DEFAULT_PAGE_TOKENS = 16
_ROOT = 0  # the key before the first page


class PrefixCache:
    def __init__(self, capacity_tokens: int, page_tokens: int = DEFAULT_PAGE_TOKENS) -> None:
        if page_tokens < 1:
            raise ValueError("page_tokens must be at least 1")
        self.capacity_tokens = capacity_tokens
        self.page_tokens = page_tokens
        # page key -> (the sequence it was cached from, the page's end in it), least recent first
        self._pages: OrderedDict[int, tuple[Sequence[int], int]] = OrderedDict()
        self._first: Sequence[int] = ()  # the sequence last cached: what followed the root

    @property
    def tokens(self) -> int:
        return len(self._pages) * self.page_tokens

    def _keys(self, ids: Sequence[int], known: list[int]) -> list[int]:
        """The key of each whole page of `ids`, a hash chained over the pages before it; the first
        len(known) are `known`."""
        step = self.page_tokens
        start = len(known) * step
        data = array("q", ids[start:]).tobytes()
        keys, key = list(known), known[-1] if known else _ROOT
        width = step * 8
        for end in range(width, len(data) + 1, width):
            key = hash((key, data[end - width : end]))
            keys.append(key)
        return keys

    def match(self, ids: Sequence[int]) -> tuple[int, list[int]]:
        """Tokens of `ids`' longest cached prefix (the pages used become recent), and `ids`' page keys."""
        keys = self._keys(ids, [])
        pages = 0
        source, end = self._first, 0
        for key in keys:
            cached = self._pages.get(key)
            if cached is None:
                break
            self._pages.move_to_end(key)
            pages += 1
            source, end = cached
        start = pages * self.page_tokens
        same = 0
        for cached_id, token in zip(
            source[end : end + self.page_tokens], ids[start : start + self.page_tokens], strict=False
        ):
            if cached_id != token:
                break
            same += 1
        return start + same, keys

    def insert(self, ids: Sequence[int], known: list[int] | None = None) -> list[int]:
        """Caches `ids` (whose first pages' keys may be `known`), evicting the least recently used
        pages beyond the capacity; returns `ids`' page keys."""
        keys = self._keys(ids, known or [])
        self._first = ids
        page = self.page_tokens
        for index, key in enumerate(keys, start=1):
            self._pages[key] = (ids, index * page)
            self._pages.move_to_end(key)
        excess = len(self._pages) - self.capacity_tokens // page
        for _ in range(max(0, excess)):
            self._pages.popitem(last=False)
        return keys

    def clear(self) -> None:
        self._pages.clear()
        self._first = ()
