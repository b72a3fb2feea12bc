"""KV-cache bookkeeping (plain Python, no torch): the block pool with reference counts.

The tensors live in the runner; this module only decides which block ids a sequence owns.
"""
from __future__ import annotations

from collections import deque


class NoFreeBlocks(RuntimeError):
    pass


class BlockPool:
    """Fixed pool of `num_blocks` block ids. A block is free when its ref count is 0."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self.peak_used = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise NoFreeBlocks(f"asked for {n} blocks, {len(self._free)} free")
        ids = [self._free.popleft() for _ in range(n)]
        for b in ids:
            self.ref_counts[b] = 1
        self.peak_used = max(self.peak_used, self.num_used)
        return ids

    def incref(self, ids: list[int]) -> None:
        for b in ids:
            if self.ref_counts[b] <= 0:
                raise ValueError(f"incref of free block {b}")
            self.ref_counts[b] += 1

    def free(self, ids: list[int]) -> None:
        """Drop one reference to each block; blocks reaching 0 return to the free pool (LIFO-reuse is avoided)."""
        for b in ids:
            rc = self.ref_counts[b]
            if rc <= 0:
                raise ValueError(f"double free of block {b}")
            self.ref_counts[b] = rc - 1
            if rc == 1:
                self._free.append(b)


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVCacheManager:
    """Grows and releases the block tables of sequences over one BlockPool."""

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)

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

    def free(self, seq) -> None:
        # free newest blocks first so the oldest (likely shared prefix) blocks are reused last
        self.pool.free(list(reversed(seq.block_table)))
        seq.block_table = []
