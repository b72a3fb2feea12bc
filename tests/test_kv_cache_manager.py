"""KVCacheManager.allocate_slots and swap: exact block ids, the watermark, and the invariant that a refusal
changes nothing and that ref counts always equal the block tables' references (plain Python, no torch)."""
import random
from collections import Counter

import pytest

from batchrun.engine.kv_cache import KVCacheManager, blocks_needed
from batchrun.engine.sequence import Sequence

BS = 4


def snapshot(kv, *seqs):
    """Everything a refused allocate_slots / swap_out / swap_in must leave as it was."""
    pool, host = kv.pool, kv.host_pool
    return (pool.num_free, list(pool.ref_counts), dict(pool.cached), pool.evictions, pool.num_touched,
            None if host is None else (host.num_free, list(host.ref_counts)),
            kv.prefix_queries, kv.prefix_hits, kv.swapped_out_blocks, kv.swapped_in_blocks,
            [(list(s.block_table), list(s.block_keys), list(s.host_blocks), s.num_computed_tokens,
              s.num_cached_tokens) for s in seqs])


def computed(kv, seq, n):
    """Admit seq and pretend its first n tokens were computed (what the engine does after a step)."""
    assert kv.allocate_slots(seq, n) is not None
    seq.num_computed_tokens = n
    kv.publish_full_blocks(seq)


def test_prefix_hits_are_reused_and_only_the_rest_is_allocated():
    kv = KVCacheManager(16, BS, enable_prefix_caching=True, watermark=0.0)
    a = Sequence("a", list(range(12)) + [1], None)
    computed(kv, a, 13)
    b = Sequence("b", list(range(12)) + [7, 7, 7, 7, 7], None)
    assert kv.allocate_slots(b, 3) == [4]               # 3 hits; 3 new tokens fit in one more block
    assert b.block_table == a.block_table[:3] + [4]
    assert b.num_computed_tokens == 12 and b.num_cached_tokens == 12
    assert [kv.pool.ref_counts[x] for x in a.block_table] == [2, 2, 2, 1]


def test_revived_cached_blocks_count_against_free_space_and_a_refusal_changes_nothing():
    kv = KVCacheManager(4, BS, enable_prefix_caching=True, watermark=0.0)
    a = Sequence("a", list(range(9)), None)
    computed(kv, a, 9)
    kv.free(a)                                          # blocks 0 and 1 stay cached, but free; 2 is plain
    x = Sequence("x", [9] * 4, None)
    assert kv.allocate_slots(x, 4) == [2]              # 3 free: 0, 1 (cached) and 3
    # b hits 0 and 1 and needs 2 more blocks: 4 leave the free pool, only 3 are free
    b = Sequence("b", list(range(8)) + [5] * 5, None)
    before = snapshot(kv, b, x)
    assert kv.allocate_slots(b, 5) is None
    assert snapshot(kv, b, x) == before
    kv.free(x)
    assert kv.allocate_slots(b, 5) == [2, 3]
    assert b.block_table == [0, 1, 2, 3] and b.num_computed_tokens == 8 and kv.pool.evictions == 0


def test_watermark_holds_back_admissions_only():
    kv = KVCacheManager(100, BS, watermark=0.1)        # 10 blocks of headroom
    assert kv.watermark_blocks == 10
    big = Sequence("big", [1] * (90 * BS), None)
    assert len(kv.allocate_slots(big, 90 * BS)) == 90  # the only holder: no watermark
    late = Sequence("late", [2] * (BS + 1), None)      # 2 blocks: 10 free, 2 + 10 > 10
    before = snapshot(kv, late)
    assert kv.allocate_slots(late, BS + 1) is None
    assert snapshot(kv, late) == before
    # a running sequence grows into the headroom: the watermark exists for it
    big.num_computed_tokens = 90 * BS
    big.token_ids.append(3)
    assert len(kv.allocate_slots(big, 1, num_lookahead_tokens=10 * BS - 1)) == 10
    assert kv.pool.num_free == 0
    kv.free(big)                                        # newest first: 99, 98, ... join the free pool
    assert kv.allocate_slots(late, BS + 1) == [99, 98]


def test_a_sequence_as_large_as_the_cache_is_admitted_alone():
    kv = KVCacheManager(8, BS, watermark=0.5)
    s = Sequence("s", [1] * (8 * BS), None)
    assert len(kv.allocate_slots(s, 8 * BS)) == 8
    assert kv.allocate_slots(Sequence("t", [1], None), 1) is None     # full


def test_num_new_tokens_is_cut_to_the_tokens_left_and_lookahead_goes_past_them():
    kv = KVCacheManager(16, BS, watermark=0.0)
    s = Sequence("s", [1] * 6, None)
    assert kv.allocate_slots(s, 1000) == [0, 1]          # a token budget larger than the prompt
    s.num_computed_tokens = 6
    s.token_ids.append(2)                                # 7 tokens, 1 to compute
    assert kv.allocate_slots(s, 1000, num_lookahead_tokens=2) == [2]     # 7 + 2 = 9 slots


def test_wait_for_prefix_sees_the_cached_tokens_and_its_refusal_changes_nothing():
    kv = KVCacheManager(16, BS, enable_prefix_caching=True, watermark=0.0)
    a = Sequence("a", list(range(12)), None)
    computed(kv, a, 8)
    b = Sequence("b", list(range(12)) + [3], None)
    seen = []
    before = snapshot(kv, a, b)
    assert kv.allocate_slots(b, 64, wait_for_prefix=lambda cached: seen.append(cached) or True) is None
    assert seen == [8] and snapshot(kv, a, b) == before
    assert kv.allocate_slots(b, 64, wait_for_prefix=lambda cached: False) is not None
    assert b.num_computed_tokens == 8


def test_swap_out_and_in_are_the_managers():
    kv = KVCacheManager(4, BS, watermark=0.0, num_host_blocks=3)
    a, b = Sequence("a", [1] * 8, None), Sequence("b", [2] * 8, None)
    kv.allocate_slots(a, 8)
    kv.allocate_slots(b, 8)
    a.num_computed_tokens = b.num_computed_tokens = 8
    assert kv.swap_out(b) == [(2, 0), (3, 1)]            # (device, host) pairs for the runner
    assert b.block_table == [] and b.host_blocks == [0, 1] and b.num_computed_tokens == 8
    assert kv.pool.num_free == 2 and kv.host_pool.num_free == 1 and kv.swapped_out_blocks == 2
    before = snapshot(kv, a, b)
    assert kv.swap_out(a) is None                        # 2 blocks, 1 host block free
    assert kv.swap_in(b) is None                         # 2 blocks + 1 for its next token > 2 free
    assert snapshot(kv, a, b) == before
    kv.free(a)
    assert kv.swap_in(b) == [(0, 3), (1, 2)]             # (host, device): the free pool's order
    assert b.block_table == [3, 2] and b.host_blocks == [] and kv.host_pool.num_free == 3
    assert kv.swapped_in_blocks == 2


def test_free_releases_host_blocks_and_no_host_pool_means_no_swap():
    kv = KVCacheManager(4, BS, watermark=0.0, num_host_blocks=2)
    s = Sequence("s", [1] * 8, None)
    kv.allocate_slots(s, 8)
    kv.swap_out(s)
    kv.free(s)                                           # finished while swapped out
    assert kv.host_pool.num_free == 2 and kv.pool.num_free == 4 and s.host_blocks == []
    plain = KVCacheManager(4, BS)
    t = Sequence("t", [1] * 4, None)
    plain.allocate_slots(t, 4)
    before = snapshot(plain, t)
    assert plain.host_pool is None and plain.swap_out(t) is None and snapshot(plain, t) == before


@pytest.mark.parametrize("seed", range(40))
def test_random_admissions_growth_swaps_and_frees_keep_the_pool_exact(seed):
    """Invariants under random work: a refusal changes nothing; a success covers exactly the slots asked
    for; ref counts equal the block tables' references; host blocks equal the swapped tables."""
    rng = random.Random(seed)
    kv = KVCacheManager(rng.randint(4, 24), BS, enable_prefix_caching=rng.random() < 0.7,
                        watermark=rng.choice([0.0, 0.1, 0.3]), num_host_blocks=rng.choice([0, 4, 16]))
    prefixes = [[rng.randrange(50) for _ in range(rng.randint(0, 12))] for _ in range(3)]
    live, swapped, refused = [], [], 0
    for step in range(200):
        op = rng.random()
        if op < 0.35:                                    # admit a new sequence
            toks = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randint(1, 10))]
            s = Sequence(str(step), toks, None)
            budget = rng.randint(1, 20)
            before = snapshot(kv, *live, s)
            new = kv.allocate_slots(s, budget)
            if new is None:
                refused += 1
                assert snapshot(kv, *live, s) == before
                continue
            n = min(budget, s.num_tokens - s.num_computed_tokens)       # past its cached prefix
            assert len(s.block_table) == blocks_needed(s.num_computed_tokens + n, BS)
            assert s.block_table[len(s.block_table) - len(new):] == new
            s.num_computed_tokens += n
            kv.publish_full_blocks(s)
            if s.num_computed_tokens == s.num_tokens:
                s.token_ids.append(rng.randrange(50))
            live.append(s)
        elif op < 0.6 and live:                          # a running sequence grows (with drafts)
            s = rng.choice(live)
            n, look = s.num_tokens - s.num_computed_tokens, rng.choice([0, 0, 3])
            before = snapshot(kv, *live)
            new = kv.allocate_slots(s, n, look)
            if new is None:
                refused += 1
                assert snapshot(kv, *live) == before
                continue
            assert len(s.block_table) >= blocks_needed(s.num_computed_tokens + n + look, BS)
            s.num_computed_tokens += n
            s.token_ids.append(rng.randrange(50))
            kv.trim(s, s.num_tokens)                      # drafts rejected
            kv.publish_full_blocks(s)
        elif op < 0.75 and live:                         # preempt by swap
            s = rng.choice(live)
            before = snapshot(kv, *live)
            pairs = kv.swap_out(s)
            if pairs is None:
                assert snapshot(kv, *live) == before
                continue
            assert [h for _, h in pairs] == s.host_blocks
            live.remove(s)
            swapped.append(s)
        elif op < 0.85 and swapped:                      # swap back in
            s = swapped[0]
            before = snapshot(kv, *live, s)
            pairs = kv.swap_in(s)
            if pairs is None:
                assert snapshot(kv, *live, s) == before
                continue
            assert [d for _, d in pairs] == s.block_table
            swapped.remove(s)
            live.append(s)
        elif live or swapped:                            # finish one
            s = rng.choice(live + swapped)
            kv.free(s)
            (live if s in live else swapped).remove(s)
        refs = Counter(b for s in live for b in s.block_table)
        assert kv.pool.ref_counts == [refs.get(b, 0) for b in range(kv.num_blocks)]
        assert kv.pool.num_used == len(refs)
        if kv.host_pool is not None:
            assert kv.host_pool.num_used == sum(len(s.host_blocks) for s in swapped)
    for s in live + swapped:
        kv.free(s)
    assert kv.pool.num_free == kv.num_blocks and kv.pool.ref_counts == [0] * kv.num_blocks
