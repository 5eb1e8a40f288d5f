"""One simulated worker's prefix cache, as SGLang's radix cache serves a prompt: the longest cached
prefix is not computed again and is reported as `meta_info.cached_tokens`.

Token sequences are cached in pages of `page_tokens`; a page is known by the hash of everything up
to its end, so a page matches only after the same prefix, and each page remembers the tokens that
last followed it, so a match is exact to the token (SGLang's default page size is 1). Pages are
evicted least recently used first once more than `capacity_tokens` are held (SGLang's
max_total_num_tokens).
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
        # page key -> the tokens that last followed the page (up to a page), least recent first
        self._pages: OrderedDict[int, tuple[int, ...]] = OrderedDict()
        self._first: tuple[int, ...] = ()  # the tokens that last began a sequence

    @property
    def tokens(self) -> int:
        return len(self._pages) * self.page_tokens

    def _keys(self, ids: Sequence[int]) -> list[int]:
        """The key of each whole page of `ids`: a hash chained over the pages before it."""
        data = array("q", ids).tobytes()
        step = self.page_tokens * 8
        keys, key = [], _ROOT
        for end in range(step, len(data) + 1, step):
            key = hash((key, data[end - step : end]))
            keys.append(key)
        return keys

    def match(self, ids: Sequence[int]) -> int:
        """Tokens of `ids`' longest cached prefix; the pages used become recent."""
        pages = 0
        following = self._first
        for key in self._keys(ids):
            cached = self._pages.get(key)
            if cached is None:
                break
            self._pages.move_to_end(key)
            pages += 1
            following = cached
        start = pages * self.page_tokens
        same = 0
        for cached_id, token in zip(following, ids[start : start + self.page_tokens], strict=False):
            if cached_id != token:
                break
            same += 1
        return start + same

    def insert(self, ids: Sequence[int]) -> None:
        """Caches `ids`, evicting the least recently used pages beyond the capacity."""
        page = self.page_tokens
        self._first = tuple(ids[:page])
        for index, key in enumerate(self._keys(ids), start=1):
            self._pages[key] = tuple(ids[index * page : (index + 1) * page])
            self._pages.move_to_end(key)
        excess = len(self._pages) - self.capacity_tokens // page
        for _ in range(max(0, excess)):
            self._pages.popitem(last=False)

    def clear(self) -> None:
        self._pages.clear()
        self._first = ()
