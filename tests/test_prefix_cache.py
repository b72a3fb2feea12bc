"""Prefix cache bookkeeping: exact block ids, ref counts, LRU eviction and the parent check (plain Python)."""
from batchrun.engine.kv_cache import KVCacheManager
from batchrun.engine.scheduler import Scheduler
from batchrun.engine.sequence import Sequence

BS = 4


def computed(kv, seq, n):
    """Admit seq and pretend its first n tokens were computed (what the engine does after a step)."""
    assert kv.allocate_slots(seq, n) is not None
    seq.num_computed_tokens = n
    kv.publish_full_blocks(seq)


def test_longest_prefix_hit_shares_blocks_and_leaves_one_token():
    kv = KVCacheManager(16, BS, enable_prefix_caching=True)
    a = Sequence("a", list(range(10)), None)           # blocks [0..3] [4..7] [8, 9]
    computed(kv, a, 10)
    assert a.block_table == [0, 1, 2] and len(a.block_keys) == 2   # only full blocks are published
    assert (kv.prefix_queries, kv.prefix_hits) == (10, 0)         # a looked its prompt up and hit nothing
    b = Sequence("b", list(range(8)) + [50, 51, 52], None)
    assert kv.allocate_slots(b, 3) == [3]              # only the block past the hits is new
    assert b.block_table == [0, 1, 3] and b.num_computed_tokens == 8 and b.num_cached_tokens == 8
    assert kv.pool.ref_counts[:4] == [2, 2, 1, 1]
    # exactly the prompt: the last full block is not taken, so at least one token is computed
    c = Sequence("c", list(range(8)), None)
    kv.allocate_slots(c, 8)
    assert c.block_table[:1] == [0] and c.num_computed_tokens == 4
    assert (kv.prefix_queries, kv.prefix_hits) == (10 + 11 + 8, 8 + 4)


def test_freed_blocks_stay_cached_until_evicted_lru():
    kv = KVCacheManager(5, BS, enable_prefix_caching=True)
    a = Sequence("a", list(range(9)), None)
    computed(kv, a, 9)
    assert a.block_table == [0, 1, 2]
    kv.free(a)                                          # freed tail first: 2, 1, 0 join the LRU end
    assert kv.pool.num_free == 5
    # a freed block holding no cached prefix (2: a partial block) is reused first, then a never-used
    # one (3) only when no used block is free ... except cached ones: those are evicted before fresh
    # blocks are touched, least recently freed first
    x = Sequence("x", [7] * 8, None)
    kv.allocate_slots(x, 4)
    assert x.block_table == [2]
    assert kv.pool.block_key[2] is None and kv.pool.evictions == 0   # block 2 held no full block
    b = Sequence("b", list(range(8)) + [99], None)
    assert kv.allocate_slots(b, 1) == [3]               # 0 and 1 still cached after free: revived
    assert b.block_table == [0, 1, 3] and b.num_computed_tokens == 8
    assert kv.pool.ref_counts == [1, 1, 1, 1, 0] and kv.pool.num_free == 1
    kv.free(b)                                          # 3 (partial) is plain; 1 then 0 rejoin the cached LRU end
    y = Sequence("y", [8] * 8, None)
    kv.allocate_slots(y, 8)
    assert y.block_table == [3, 1] and kv.pool.evictions == 1   # plain, then the least recently freed cached
    assert kv.pool.num_touched == 4                             # block 4 never touched
    c = Sequence("c", list(range(8)) + [5], None)
    kv.allocate_slots(c, 1)
    assert c.block_table[0] == 0 and c.num_computed_tokens == 4     # block 1's entry is gone


def test_eviction_drops_the_cache_entry():
    kv = KVCacheManager(2, BS, enable_prefix_caching=True)
    a = Sequence("a", list(range(9)), None)
    computed(kv, a, 8)
    kv.free(a)
    y = Sequence("y", [5] * 8, None)
    kv.allocate_slots(y, 8)                             # takes both blocks: both cached entries evicted
    assert kv.pool.evictions == 2 and not kv.pool.cached
    kv.free(y)
    b = Sequence("b", list(range(5)), None)
    assert kv.allocate_slots(b, 5) is not None and b.num_computed_tokens == 0


def test_hit_requires_the_recorded_parent():
    kv = KVCacheManager(8, BS, enable_prefix_caching=True)
    a = Sequence("a", [1, 1, 1, 1, 2, 2, 2, 2, 0], None)
    computed(kv, a, 8)
    # forge a collision: same second-block key, but a chain that did not go through a's first block
    key2 = a.block_keys[1]
    kv.pool.block_parent[kv.pool.cached[key2]] = 7
    b = Sequence("b", [1, 1, 1, 1, 2, 2, 2, 2, 3], None)
    kv.allocate_slots(b, 9)
    assert b.num_computed_tokens == 4 and b.block_table[0] == a.block_table[0]
    assert b.block_table[1] not in a.block_table


def test_scheduler_waits_for_an_in_flight_prefix_then_reuses_it():
    kv = KVCacheManager(32, BS, enable_prefix_caching=True, watermark=0.0)
    s = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64)
    shared = list(range(100, 112))                     # three full blocks
    a, b = Sequence("a", shared + [1, 2], None), Sequence("b", shared + [3], None)
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert [e.seq.request_id for e in out.scheduled] == ["a"]     # b would recompute a's prefix
    for e in out.scheduled:
        e.seq.num_computed_tokens += e.num_new_tokens
        kv.publish_full_blocks(e.seq)
        e.seq.token_ids.append(9)
    out = s.schedule()
    ents = {e.seq.request_id: e.num_new_tokens for e in out.scheduled}
    assert ents == {"a": 1, "b": 1}                   # b computes only its own last token
    assert b.block_table[:3] == a.block_table[:3] and b.num_cached_tokens == 12
