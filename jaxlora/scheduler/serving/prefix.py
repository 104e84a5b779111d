"""Prefix caching (vLLM's automatic prefix caching, SGLang's RadixAttention): KV pages of full
blocks reused by later requests with the same adapter and the same token prefix (host bookkeeping,
no JAX).

A block is one page: `page_size` token positions. Block i of a sequence is named by a hash chain,
    digest_i = sha256(digest_{i-1} || tokens of block i as int32),  digest_{-1} = sha256(root),
so a digest names the whole prefix up to and including its block (vLLM's block hash). `root` is
the caller's identity of what computed the keys and values besides the tokens (vLLM's
`extra_keys`): the adapter's identity (the engine's adapter uid, new for every registration: an
adapter registered again with other weights never meets the old pages; the base model: None) and
the numerics tag of the step (an inference mode with merged weights computes other bits), so
another adapter, or the base model, never shares a page.

`PrefixCache` sits in front of the page pool (`PageAllocator`, or `UnifiedPages` whose adapter
side it forwards) with the pool's interface, so the scheduler allocates through it:
  - a page holding a full computed block is registered under its digest (`register`); one digest
    names at most one page (a block computed twice by requests admitted together stays private to
    the second and is freed as usual);
  - registered pages are reference counted: each sequence that holds one counts once (`acquire`
    on a hit, `free` when the sequence ends or is preempted); at zero the page stays cached, in an
    LRU of unreferenced pages;
  - unreferenced cached pages count as free (`num_free`, `can_allocate`): `allocate` takes the free
    list first, then evicts the least recently used cached pages, and only then (unified paging)
    lets the pool evict idle adapters; an adapter placed in the unified budget evicts cached pages
    too (`add_adapter`), so cached KV never holds adapters out;
  - a hit page leaves the LRU while held and comes back as its most recently used;
  - `lookup(digests)` gives the pages of the longest run of leading digests that are cached; the
    scheduler takes at most (tokens - 1) // page_size of them, so a prefill always computes at
    least the last token (its logits give the first sampled token).

Hit rate (`PrefixStats`): prompt tokens looked up at admission and tokens found cached (vLLM's
`prefix_cache_queries` / `prefix_cache_hits`).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
from typing import Hashable

import numpy as np


@functools.lru_cache(maxsize=4096)
def root_digest(root: Hashable) -> bytes:
    """digest_{-1} of a chain: sha256 of `repr(root)` (the root is built of ints, strings, None;
    remembered: the scheduler asks for a running sequence's root whenever it registers a block)."""
    return hashlib.sha256(repr(root).encode()).digest()


def chain_digests(tokens, page_size: int, root: bytes, digests: list[bytes], count: int) -> list[bytes]:
    """`digests` (the chain of `tokens`' first blocks so far) extended in place to `count` full
    blocks of `tokens` (list of ints, at least count * page_size long); returns it."""
    for i in range(len(digests), count):
        block = np.asarray(tokens[i * page_size: (i + 1) * page_size], np.int32)
        digests.append(hashlib.sha256((digests[-1] if digests else root) + block.tobytes()).digest())
    return digests


@dataclasses.dataclass
class PrefixStats:
    """Counters: queries (prompt tokens looked up when their requests were admitted), hits (of those,
    tokens whose keys and values were reused), requests (admissions looked up) and hit_requests (with
    at least one block reused), evictions (cached pages given back to the pool), cached_blocks (blocks
    registered so far)."""

    queries: int = 0
    hits: int = 0
    requests: int = 0
    hit_requests: int = 0
    evictions: int = 0
    cached_blocks: int = 0

    @property
    def hit_rate(self) -> float:
        """Hit tokens / queried tokens (0 before any query)."""
        return self.hits / self.queries if self.queries else 0.0

    def record(self, tokens: int, hit_tokens: int) -> None:
        self.requests += 1
        self.queries += tokens
        self.hits += hit_tokens
        self.hit_requests += hit_tokens > 0


class PrefixCache:
    """Cached full-block KV pages over a page pool (module doc). pages: a `PageAllocator` or
    `UnifiedPages`; attributes it does not define are the pool's (the unified adapter side)."""

    def __init__(self, pages, page_size: int):
        self.pool = pages
        self.page_size = page_size
        self.stats = PrefixStats()
        self._page_of: dict[bytes, int] = {}  # digest -> its page
        self._digest_of: dict[int, bytes] = {}  # registered page -> its digest
        self._owner: dict[int, Hashable] = {}  # registered page -> its adapter key (`forget`)
        self._refs: dict[int, int] = {}  # shared page (registered, or detached by `forget`) -> holders
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # unreferenced, oldest first

    def __getattr__(self, name: str):  # the pool's own (UnifiedPages' adapter side, counts)
        if name == "pool":
            raise AttributeError(name)
        return getattr(self.pool, name)

    # ---- counts ------------------------------------------------------------------------------
    @property
    def num_cached(self) -> int:
        """Cached pages no sequence holds (evictable)."""
        return len(self._lru)

    @property
    def num_registered(self) -> int:
        return len(self._digest_of)

    @property
    def num_free(self) -> int:
        """Free pages plus unreferenced cached ones."""
        return self.pool.num_free + len(self._lru)

    def num_free_besides(self, keep) -> int:
        """Free pages plus unreferenced cached ones other than those of `keep` (a request's hits)."""
        return self.pool.num_free + self._evictable(keep)

    def _evictable(self, keep=()) -> int:
        return len(self._lru) - sum(1 for page in keep if page in self._lru)

    # ---- the pool's interface -----------------------------------------------------------------
    def can_allocate(self, count: int, keep=()) -> bool:
        """Whether `count` pages can be had, evicting cached pages other than those of `keep` (the
        hits of the request asking)."""
        return self.pool.can_allocate(max(0, count - self._evictable(keep)))

    def allocate(self, count: int, keep=()) -> list[int]:
        """`count` pages: the free list first, then cached pages (LRU, not those of `keep`), then
        the pool's own eviction (idle adapters); ValueError (nothing changed) if that is short."""
        if not self.can_allocate(count, keep):
            raise ValueError(f"{count} pages requested, {self.pool.num_free} free and {self._evictable(keep)} cached")
        self._reclaim(lambda: self.pool.num_free >= count, keep)
        return self.pool.allocate(count)

    def free(self, pages: list[int]) -> None:
        """A sequence gives its pages back (in its block order): a shared page loses a holder (cached
        when none is left, or back to the pool once `forget` detached it), a private one goes back
        to the pool. Cached pages join the LRU last block first, so a chain is evicted from its tail
        (vLLM's free-block order; SGLang's radix tree evicts leaves first): a block whose parent is
        gone can never be hit."""
        private = []
        for page in reversed(pages):
            if page not in self._refs:
                private.append(page)
                continue
            self._refs[page] -= 1
            if self._refs[page]:
                continue
            del self._refs[page]
            if page in self._digest_of:
                self._lru[page] = None
            else:
                private.append(page)
        if private:
            self.pool.free(private)

    def add_adapter(self, key, count: int, rows: int = 0):
        """Unified paging: `UnifiedPages.add_adapter`, evicting cached pages (LRU) before idle
        adapters: until its `count` pages are free (cached KV never keeps an adapter out)."""
        if not self.pool.holds(key):
            self._reclaim(lambda: self.pool.num_free >= count)
        return self.pool.add_adapter(key, count, rows)

    def _reclaim(self, enough, keep=()) -> None:
        """Evicts unreferenced cached pages, least recently used first (not those of `keep`), until
        `enough()` or none is left (the LRU is walked only when pages are short: allocations run
        every step, and a full cache holds thousands of pages)."""
        if enough():
            return
        for page in [page for page in self._lru if page not in keep]:
            if enough():
                return
            self._evict(page)

    def _evict(self, page: int) -> None:
        del self._lru[page]
        self._unregister(page)
        self.pool.free([page])
        self.stats.evictions += 1

    def _unregister(self, page: int) -> None:
        del self._page_of[self._digest_of.pop(page)]
        self._owner.pop(page, None)

    # ---- the cache ---------------------------------------------------------------------------
    def lookup(self, digests: list[bytes]) -> list[int]:
        """The pages of the longest run of leading `digests` that are cached."""
        pages = []
        for digest in digests:
            page = self._page_of.get(digest)
            if page is None:
                break
            pages.append(page)
        return pages

    def acquire(self, pages: list[int]) -> None:
        """A sequence takes cached `pages` (from `lookup`): each gains a holder, leaves the LRU and
        becomes its most recently used."""
        for page in pages:
            self._refs[page] = self._refs.get(page, 0) + 1
            self._lru.pop(page, None)

    def register(self, page: int, digest: bytes, owner: Hashable = None) -> bool:
        """Caches a sequence's private `page` (a full computed block) under `digest`; the sequence
        holds it. False (nothing changed) when that digest is cached already or the page is shared."""
        if digest in self._page_of or page in self._refs:
            return False
        self._page_of[digest] = page
        self._digest_of[page] = digest
        self._owner[page] = owner
        self._refs[page] = 1
        self.stats.cached_blocks += 1
        return True

    def forget(self, owner: Hashable = ...) -> None:
        """Drops the cached blocks of adapter `owner` (default: every block): unreferenced pages go
        back to the pool, held ones stay with their sequences (detached: freed when the last lets go)."""
        for page in [p for p, key in self._owner.items() if owner is ... or key == owner]:
            if page in self._lru:
                del self._lru[page]
                self._unregister(page)
                self.pool.free([page])
            else:
                self._unregister(page)
