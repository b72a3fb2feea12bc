"""BlockPool: a fixed pool of KV block ids with ref counts and the prefix cache's index (plain Python, no torch).

A full block is published under (parent block's key hash, its tokens). A lookup hits only when the cached
block's recorded parent is the block matched just before it, so a hash collision can never splice foreign
K/V into a sequence. Freed blocks keep their key and stay matchable until evicted, least recently freed
first. The host swap pool is a second BlockPool (no prefix cache used).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Optional


class NoFreeBlocks(RuntimeError):
    """BlockPool.allocate asked for more blocks than are free."""


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold `num_tokens` tokens."""
    return -(-num_tokens // block_size)


class BlockPool:
    """Fixed pool of `num_blocks` ids. A block with ref count 0 is free (and evictable if cached).

    The KV tensors behind the pool are allocated untouched (no RSS on CPU until a block is first
    written), so the pool hands out a never-used id only when no used one is free: the memory a job
    touches follows its peak working set, not the pool's size. Free used blocks are taken in this
    order: those holding no cached prefix (least recently freed first), then cached ones, least
    recently freed first, evicting their cache entry.
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free_plain: OrderedDict[int, None] = OrderedDict()    # free, used before, nothing cached
        self._free_cached: OrderedDict[int, None] = OrderedDict()   # free, holding a published block; LRU first
        self._next_fresh = 0                                        # ids >= this were never handed out
        self._num_used = 0
        self.peak_used = 0
        # prefix cache
        self.block_key: list[Optional[Hashable]] = [None] * num_blocks
        self.block_parent: list[int] = [-1] * num_blocks
        self.cached: dict[Hashable, int] = {}
        self.evictions = 0

    @property
    def num_free(self) -> int:
        return self.num_blocks - self._num_used

    @property
    def num_used(self) -> int:
        return self._num_used

    @property
    def num_touched(self) -> int:
        """Blocks ever handed out: all the KV tensors have paged in."""
        return self._next_fresh

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise NoFreeBlocks(f"asked for {n} blocks, {self.num_free} free")
        ids = []
        plain, cached = self._free_plain, self._free_cached
        for _ in range(n):
            if plain:
                b, _ = plain.popitem(last=False)
            elif cached:
                b, _ = cached.popitem(last=False)
                del self.cached[self.block_key[b]]          # evict its cached content
                self.block_key[b] = None
                self.evictions += 1
            else:
                b = self._next_fresh
                self._next_fresh += 1
            self.ref_counts[b] = 1
            ids.append(b)
        self._num_used += n
        if self._num_used > self.peak_used:
            self.peak_used = self._num_used
        return ids

    def incref(self, ids: list[int]) -> None:
        for b in ids:
            if self.ref_counts[b] <= 0:
                raise ValueError(f"incref of free block {b}")
            self.ref_counts[b] += 1

    def free(self, ids: list[int]) -> None:
        """Drop one reference to each block; a block reaching 0 joins the free pool's most-recent end."""
        for b in ids:
            rc = self.ref_counts[b]
            if rc <= 0:
                raise ValueError(f"double free of block {b}")
            self.ref_counts[b] = rc - 1
            if rc == 1:
                (self._free_plain if self.block_key[b] is None else self._free_cached)[b] = None
                self._num_used -= 1

    # -- prefix cache ------------------------------------------------------------------------
    def lookup(self, key: Hashable, parent: int) -> Optional[int]:
        """The block published under key with `parent` (-1: none) before it, else None."""
        b = self.cached.get(key)
        if b is None or self.block_parent[b] != parent:
            return None
        return b

    def take_cached(self, b: int) -> None:
        """Add a reference to cached block b, reviving it from the free pool if needed."""
        if self.ref_counts[b] == 0:
            del self._free_cached[b]              # a cached block is free only in _free_cached
            self._num_used += 1
            self.peak_used = max(self.peak_used, self._num_used)
        self.ref_counts[b] += 1

    def register(self, b: int, key: Hashable, parent: int) -> None:
        """Publish full block b under key, unless an identical block is already published."""
        if key in self.cached or self.block_key[b] is not None:
            return
        self.cached[key] = b
        self.block_key[b] = key
        self.block_parent[b] = parent

    def num_free_among(self, ids: list[int]) -> int:
        """How many of `ids` are free (cached blocks a taker would revive out of the free pool)."""
        return sum(1 for b in ids if self.ref_counts[b] == 0)
