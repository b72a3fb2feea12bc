"""KVCacheManager: which KV block ids each sequence owns, on the device and in the host swap pool (plain
Python, no torch). The tensors live in the runner; the scheduler asks this class and never a pool.

allocate_slots is the one admission question: it takes a new sequence's cached prefix, keeps the
watermark, allocates, and says None (changing nothing) when the work does not fit. swap_out/swap_in move
a preempted sequence's blocks to and from the host pool and return the (src, dst) pairs the runner copies.
Blocks with ref count > 1 are shared and never written: only blocks past a sequence's last cache hit are.
"""
from __future__ import annotations

from typing import Callable, Hashable, Optional

from batchrun.engine.block_pool import BlockPool, NoFreeBlocks, blocks_needed

__all__ = ["BlockPool", "KVCacheManager", "NoFreeBlocks", "blocks_needed"]


class KVCacheManager:
    """Block tables of sequences over one device BlockPool, with optional prefix caching and host swap pool.

    watermark: share of the device blocks an admission must leave free while other sequences hold blocks
    (headroom for their decodes, so a new sequence does not force a preemption at once); a sequence that
    would be the only holder is admitted without it, so one large sequence is never locked out.
    num_host_blocks: blocks of the host swap pool (0: none; preemption then recomputes).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 watermark: float = 0.01, num_host_blocks: int = 0):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.host_pool: Optional[BlockPool] = BlockPool(num_host_blocks) if num_host_blocks else None
        self.enable_prefix_caching = enable_prefix_caching
        self.watermark_blocks = int(watermark * num_blocks)
        self.prefix_queries = 0      # prompt tokens looked up
        self.prefix_hits = 0         # prompt tokens served from cache
        self.swapped_out_blocks = 0
        self.swapped_in_blocks = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    # -- admission and growth ----------------------------------------------------------------
    def allocate_slots(self, seq, num_new_tokens: int, num_lookahead_tokens: int = 0,
                       wait_for_prefix: Optional[Callable[[int], bool]] = None) -> Optional[list[int]]:
        """Grow seq's block table to cover its computed tokens, up to `num_new_tokens` more of its own
        tokens (fewer when fewer are left) and `num_lookahead_tokens` slots past them (draft tokens).

        A sequence holding no blocks is being admitted: its longest cached prefix is taken first
        (seq.num_computed_tokens moves past it; at least one token is left to compute), and the watermark
        applies. With prefix caching on, wait_for_prefix(cached prompt tokens) -> True refuses it for now
        (its next block is being computed by another sequence: waiting a step reuses it).
        Returns the newly allocated block ids ([] when none were needed), or None when the work does not
        fit or must wait; then nothing changed.
        """
        table = seq.block_table
        if table:       # the hot path of a decode step (once per running sequence): no lookup, no watermark
            computed = seq.num_computed_tokens
            left = len(seq.token_ids) - computed
            end = computed + (num_new_tokens if num_new_tokens < left else left) + num_lookahead_tokens
            need = -(-end // self.block_size) - len(table)
            if need <= 0:
                return []
            if need > self.pool.num_free:
                return None
            new = self.pool.allocate(need)
            table.extend(new)
            return new
        bs, pool = self.block_size, self.pool
        # prompt_logprobs need every prompt position's logits: such a prompt is computed, never looked up
        lookup = self.enable_prefix_caching and getattr(seq.params, "prompt_logprobs", None) is None
        hits, keys = self._match_prefix(seq) if lookup else ([], [])
        start = len(hits) * bs
        if self.enable_prefix_caching and wait_for_prefix is not None and wait_for_prefix(start):
            return None
        n = min(num_new_tokens, seq.num_tokens - start) + num_lookahead_tokens
        need = blocks_needed(start + n, bs) - len(hits)
        reserve = self.watermark_blocks if pool.num_used else 0
        # revived cached blocks leave the free pool too
        if need + pool.num_free_among(hits) + reserve > pool.num_free:
            return None
        if self.enable_prefix_caching:
            self._adopt_prefix(seq, hits, keys)
        new = pool.allocate(need)
        seq.block_table.extend(new)
        return new

    def trim(self, seq, num_tokens: int) -> None:
        """Release blocks past those `num_tokens` tokens need (slots of rejected draft tokens)."""
        keep = blocks_needed(num_tokens, self.block_size)
        if len(seq.block_table) > keep:
            self.pool.free(list(reversed(seq.block_table[keep:])))
            del seq.block_table[keep:]

    def free(self, seq) -> None:
        """Release every block of seq, on the device and in the host pool."""
        self._free_device(seq)
        if seq.host_blocks:
            self.host_pool.free(seq.host_blocks)
            seq.host_blocks = []

    def _free_device(self, seq) -> None:
        # newest blocks first, so a prefix's tail is evicted before its head
        self.pool.free(list(reversed(seq.block_table)))
        seq.block_table = []
        seq.block_keys = []

    # -- swap -------------------------------------------------------------------------------
    def swap_out(self, seq) -> Optional[list[tuple[int, int]]]:
        """Move seq's device blocks to host blocks: the (device, host) pairs to copy, or None (no host pool,
        or no room in it; nothing changed). The device blocks are free at once: the runner copies them out
        before the step's forward can reuse them."""
        host, n = self.host_pool, len(seq.block_table)
        if host is None or n > host.num_free:
            return None
        seq.host_blocks = host.allocate(n)
        pairs = list(zip(seq.block_table, seq.host_blocks))
        self.swapped_out_blocks += n
        self._free_device(seq)
        return pairs

    def swap_in(self, seq) -> Optional[list[tuple[int, int]]]:
        """Move a swapped-out seq back to device blocks: the (host, device) pairs to copy, or None when the
        device lacks room for its blocks plus the one its next token may open (nothing changed)."""
        n = len(seq.host_blocks)
        if n + 1 > self.pool.num_free:
            return None
        dev = self.pool.allocate(n)
        pairs = list(zip(seq.host_blocks, dev))
        # freed now: a swap-out in this same step may reuse them (the runner copies swap-ins first)
        self.host_pool.free(seq.host_blocks)
        self.swapped_in_blocks += n
        seq.host_blocks = []
        seq.block_table = dev
        return pairs

    # -- prefix cache ------------------------------------------------------------------------
    def _key(self, parent_key: Optional[Hashable], seq, i: int) -> Hashable:
        bs = self.block_size
        return (hash(parent_key), tuple(seq.token_ids[i * bs:(i + 1) * bs]))

    def _match_prefix(self, seq) -> tuple[list[int], list[Hashable]]:
        """Cached blocks (and their keys) of seq's longest cached prefix, leaving >= 1 token to compute."""
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

    def _adopt_prefix(self, seq, hits: list[int], keys: list[Hashable]) -> None:
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
