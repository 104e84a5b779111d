"""Unified paging (S-LoRA §5.1): one budget of equal pages shared by KV blocks and adapter weights
(host bookkeeping, no JAX).

A page is the size of one KV page (`page_size` tokens of K and V over every layer); a sequence's
KV takes whole pages as in `PageAllocator`, and an adapter takes the pages its weights fill at its
own rank: r rows of A and of B per target module and layer, no max-rank padding
(`adapter_pages`), so a rank-8 adapter takes a quarter of a rank-32 one's pages. Both kinds come
from one free list, so adapter room and KV room trade against each other:
  - KV pages (`allocate`) never wait for adapters that nothing uses: when the free list runs
    short, resident adapters that are not in use are evicted first, least recently used first;
  - an adapter (`add_adapter`) gets its pages from the free list, then from evicting other idle
    adapters; KV pages are never taken from sequences (no preemption);
  - an adapter in use (`in_use(key)`, the caller's test: e.g. its device slot is pinned by running
    requests) is never evicted.
Allocation is all-or-nothing: a request that cannot be met changes nothing. Adapters evicted to make
room are returned to the caller (it frees their device copies).

Adapter rows (`num_rows` > 0: the device layout of `jaxlora.lora.rows.RowPool`): an adapter of rank
r also takes exactly r row ids of the device row pool (`add_adapter(key, count, rows=r)`, its row
table `rows_of(key)`), from a free list of its own, so after frees an adapter's rows are scattered
(the kernels read them through the table). Pages are the byte budget shared with KV; rows are the
physical places on the device. An adapter is placed when both suffice (evicting idle adapters, LRU,
until they do) and eviction frees exactly its pages and its rows.

`PageAllocator`'s interface (`num_free`, `can_allocate`, `allocate`, `free`) is the KV side, so the
serving scheduler can use this pool in its place (`SchedulerConfig.unified_paging`).
"""

from __future__ import annotations

import collections
from typing import Callable, Hashable


def adapter_pages(rank_row_bytes: int, page_bytes: int) -> int:
    """Pages for adapter weights of `rank_row_bytes` bytes (its A and B rows at its own rank over
    every target module and layer): the bytes rounded up to whole pages."""
    if page_bytes < 1:
        raise ValueError(f"page_bytes must be >= 1, got {page_bytes}")
    return -(-rank_row_bytes // page_bytes)


class UnifiedPages:
    """`num_pages` pages shared by KV blocks and resident adapters (module doc)."""

    def __init__(self, num_pages: int, page_size: int, in_use: Callable[[Hashable], bool] = lambda key: False,
                 num_rows: int = 0):
        if num_pages < 1 or page_size < 1 or num_rows < 0:
            raise ValueError(f"num_pages and page_size must be >= 1 and num_rows >= 0, got {num_pages}, "
                             f"{page_size}, {num_rows}")
        self.num_pages, self.page_size, self.num_rows = num_pages, page_size, num_rows
        self.in_use = in_use
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self._free_rows = list(range(num_rows - 1, -1, -1))
        self._kv: set[int] = set()
        self._adapters: collections.OrderedDict[Hashable, list[int]] = collections.OrderedDict()  # LRU first
        self._rows: dict[Hashable, list[int]] = {}  # adapter -> its row ids (rank order)
        self.evicted: list[Hashable] = []  # adapters evicted since the caller last cleared this

    # ---- counts ------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def kv_pages(self) -> int:
        return len(self._kv)

    @property
    def adapter_pages_used(self) -> int:
        return sum(len(pages) for pages in self._adapters.values())

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    @property
    def adapter_rows_used(self) -> int:
        return sum(len(rows) for rows in self._rows.values())

    def idle_pages(self, keep=()) -> int:
        """Pages of resident adapters that are not in use (and not in `keep`): what eviction can free."""
        return sum(len(p) for key, p in self._adapters.items() if key not in keep and not self.in_use(key))

    def idle_rows(self, keep=()) -> int:
        """Rows of resident adapters that are not in use (and not in `keep`)."""
        return sum(len(r) for key, r in self._rows.items() if key not in keep and not self.in_use(key))

    # ---- KV side (PageAllocator's interface) ------------------------------------------------------
    def can_allocate(self, count: int) -> bool:
        return count <= len(self._free) or count <= len(self._free) + self.idle_pages()

    def allocate(self, count: int) -> list[int]:
        """`count` KV page ids, evicting idle adapters (LRU) if the free list is short; ValueError
        (and nothing changed) if even that is not enough."""
        if not self.can_allocate(count):
            raise ValueError(f"{count} pages requested, {len(self._free)} free and {self.idle_pages()} held by idle "
                             "adapters")
        self._make_room(count)
        pages = [self._free.pop() for _ in range(count)]
        self._kv.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        """Returns KV pages (each must be a KV page in use)."""
        for page in pages:
            if page not in self._kv:
                raise ValueError(f"page {page} is not a KV page in use")
        for page in pages:
            self._kv.remove(page)
            self._free.append(page)

    # ---- adapter side ------------------------------------------------------------------------
    def holds(self, key) -> bool:
        return key in self._adapters

    def pages_of(self, key) -> list[int]:
        """The page ids holding adapter `key` (its page table)."""
        return list(self._adapters[key])

    def rows_of(self, key) -> list[int]:
        """The device row ids of adapter `key`, rank row j at index j (its row table; [] without rows)."""
        return list(self._rows[key])

    def can_add(self, key, count: int, rows: int = 0) -> bool:
        keep = (key,)
        return key in self._adapters or (
            (count <= len(self._free) or count <= len(self._free) + self.idle_pages(keep))
            and (rows <= len(self._free_rows) or rows <= len(self._free_rows) + self.idle_rows(keep)))

    def add_adapter(self, key, count: int, rows: int = 0) -> list[int] | None:
        """Pages for adapter `key` (`count` of them, and `rows` device row ids: its rank; already
        resident: its pages, marked recently used), evicting other idle adapters (LRU) if needed;
        None (nothing changed) if that is not enough."""
        if key in self._adapters:
            self.touch(key)
            return self.pages_of(key)
        if count < 1:
            raise ValueError(f"an adapter takes >= 1 page, got {count}")
        if rows > self.num_rows or (rows < 1 and self.num_rows):
            raise ValueError(f"an adapter takes 1..{self.num_rows} rows here, got {rows}")
        if not self.can_add(key, count, rows):
            return None
        self._make_room(count, rows)
        self._adapters[key] = [self._free.pop() for _ in range(count)]
        self._rows[key] = [self._free_rows.pop() for _ in range(rows)]
        return self.pages_of(key)

    def touch(self, key) -> None:
        if key in self._adapters:
            self._adapters.move_to_end(key)

    def remove_adapter(self, key) -> None:
        """Frees adapter `key`'s pages (nothing if it is not resident); ValueError if it is in use."""
        if key not in self._adapters:
            return
        if self.in_use(key):
            raise ValueError(f"adapter {key!r} is in use")
        self._release(key)

    def _release(self, key) -> None:
        self._free.extend(self._adapters.pop(key))
        self._free_rows.extend(self._rows.pop(key))

    def _make_room(self, count: int, rows: int = 0) -> None:
        """Evicts idle adapters, least recently used first, until `count` pages and `rows` rows
        are free (the caller checked that they suffice)."""
        for key in list(self._adapters):
            if len(self._free) >= count and len(self._free_rows) >= rows:
                return
            if not self.in_use(key):
                self._release(key)
                self.evicted.append(key)
