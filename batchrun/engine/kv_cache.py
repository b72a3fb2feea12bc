"""KV-cache bookkeeping (plain Python, no torch): block pool, ref counts, prefix-cache hashes, host swap pool.

The tensors live in the runner; this module only decides which block ids a sequence owns.

Prefix caching: a full block is keyed by (parent block's key hash, its tokens). A hit is accepted only
when the cached block's recorded parent is the block matched just before it, so a hash collision can
never splice foreign K/V into a sequence. Freed blocks keep their key and stay matchable until
evicted, least recently freed first. Blocks with ref count > 1 are shared and never written: only
blocks past a sequence's last cache hit are ever written.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Optional


class NoFreeBlocks(RuntimeError):
    pass


def blocks_needed(num_tokens: int, block_size: int) -> int:
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
        return sum(1 for b in ids if self.ref_counts[b] == 0)


class KVCacheManager:
    """Grows and releases the block tables of sequences over one BlockPool, with optional prefix caching."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_queries = 0      # prompt tokens looked up
        self.prefix_hits = 0         # prompt tokens served from cache

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def num_new_blocks(self, seq, num_tokens: int) -> int:
        """Blocks `seq` still needs so that its table covers `num_tokens` tokens."""
        return max(0, blocks_needed(num_tokens, self.block_size) - len(seq.block_table))

    def can_allocate(self, n: int, reserve: int = 0) -> bool:
        return n + reserve <= self.pool.num_free

    def allocate(self, seq, num_tokens: int) -> None:
        n = self.num_new_blocks(seq, num_tokens)
        if n:
            seq.block_table.extend(self.pool.allocate(n))

    def trim(self, seq, num_tokens: int) -> None:
        """Release blocks past those `num_tokens` tokens need (slots of rejected draft tokens)."""
        keep = blocks_needed(num_tokens, self.block_size)
        if len(seq.block_table) > keep:
            self.pool.free(list(reversed(seq.block_table[keep:])))
            del seq.block_table[keep:]

    def free(self, seq) -> None:
        # newest blocks first, so a prefix's tail is evicted before its head
        self.pool.free(list(reversed(seq.block_table)))
        seq.block_table = []
        seq.block_keys = []

    # -- prefix cache ------------------------------------------------------------------------
    def _key(self, parent_key: Optional[Hashable], seq, i: int) -> Hashable:
        bs = self.block_size
        return (hash(parent_key), tuple(seq.token_ids[i * bs:(i + 1) * bs]))

    def match_prefix(self, seq) -> tuple[list[int], list[Hashable]]:
        """Cached blocks (and their keys) of seq's longest cached prefix, leaving >= 1 token to compute."""
        if not self.enable_prefix_caching:
            return [], []
        keys: list[Hashable] = []
        hits: list[int] = []
        for i in range((seq.num_tokens - 1) // self.block_size):
            key = self._key(keys[-1] if keys else None, seq, i)
            b = self.pool.lookup(key, hits[-1] if hits else -1)
            if b is None:
                break
            keys.append(key)
            hits.append(b)
        return hits, keys

    def adopt_prefix(self, seq, hits: list[int], keys: list[Hashable]) -> None:
        """Give seq (with an empty table) the blocks match_prefix found."""
        if not self.enable_prefix_caching:
            return
        for b in hits:
            self.pool.take_cached(b)
        seq.block_table = list(hits)
        seq.block_keys = list(keys)
        seq.num_computed_tokens = len(hits) * self.block_size
        if seq.num_output_tokens == 0:   # count prompts, not recomputations after preemption
            self.prefix_queries += seq.num_prompt_tokens
            self.prefix_hits += seq.num_computed_tokens
            seq.num_cached_tokens = seq.num_computed_tokens

    def publish_full_blocks(self, seq) -> None:
        """Register the blocks that became full of computed tokens in this step."""
        if not self.enable_prefix_caching:
            return
        pool = self.pool
        for i in range(len(seq.block_keys), seq.num_computed_tokens // self.block_size):
            parent_key = seq.block_keys[i - 1] if i else None
            # chain to the published copy of the parent (ours, or an identical block that won the race)
            parent = -1 if i == 0 else pool.cached.get(parent_key, -2)
            key = self._key(parent_key, seq, i)
            seq.block_keys.append(key)
            if parent != -2:
                pool.register(seq.block_table[i], key, parent)
