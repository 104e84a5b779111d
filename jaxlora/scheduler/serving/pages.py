"""KV-cache page bookkeeping: which pages of the device page pool are free (host side, no JAX)."""

from __future__ import annotations


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages needed to hold `num_tokens` positions."""
    return -(-num_tokens // page_size)


def admission_pages(tokens: int, max_len: int, page_size: int, reserve_output: bool) -> int:
    """Pages a request with `tokens` tokens so far (prompt, plus any output it resumes with) and
    at most `max_len` (prompt + max_tokens) takes when admitted: all `max_len` positions when
    admission reserves the output, else its tokens and the next one (its first decode step)."""
    return pages_for(max_len if reserve_output else min(tokens + 1, max_len), page_size)


class PageAllocator:
    """A free list over page ids 0..num_pages-1. Allocation is all-or-nothing."""

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages and page_size must be >= 1, got {num_pages}, {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, count: int) -> bool:
        return count <= len(self._free)

    def allocate(self, count: int) -> list[int]:
        """`count` page ids; ValueError (and nothing taken) if fewer are free."""
        if count > len(self._free):
            raise ValueError(f"{count} pages requested, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(count)]
        self._used.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        """Returns pages to the free list (each must be in use)."""
        for page in pages:
            if page not in self._used:
                raise ValueError(f"page {page} is not in use")
            self._used.remove(page)
            self._free.append(page)
