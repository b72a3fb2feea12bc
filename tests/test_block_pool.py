"""Block pool and KV-cache manager: exact block ids and ref counts (plain Python, no torch)."""
import pytest

from batchrun.engine.kv_cache import BlockPool, KVCacheManager, NoFreeBlocks, blocks_needed
from batchrun.engine.sequence import Sequence


def test_allocate_free_exact_ids_and_counts():
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    assert pool.ref_counts == [1, 1, 0, 0]
    assert (pool.num_free, pool.num_used, pool.peak_used) == (2, 2, 2)
    pool.incref([1])
    assert pool.ref_counts == [1, 2, 0, 0]
    pool.free([0, 1])
    assert pool.ref_counts == [0, 1, 0, 0]
    assert pool.num_free == 3            # block 1 still referenced
    # a used block is reused before a never-used one: the KV pages touched follow the working set
    assert pool.allocate(3) == [0, 2, 3]
    assert pool.num_touched == 4
    with pytest.raises(NoFreeBlocks):
        pool.allocate(1)
    pool.free([1, 2, 3, 0])
    assert pool.num_free == 4 and pool.ref_counts == [0, 0, 0, 0]
    assert pool.peak_used == 4


def test_double_free_and_incref_of_free_block_are_errors():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(ValueError, match="double free"):
        pool.free([b])
    with pytest.raises(ValueError, match="incref of free block"):
        pool.incref([b])


def test_manager_grows_tables_by_block_and_frees_all():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a, b = Sequence("a", [1] * 5, None), Sequence("b", [1] * 4, None)
    assert kv.allocate_slots(a, 5) == [0, 1]
    assert kv.allocate_slots(b, 4) == [2]
    assert a.block_table == [0, 1] and b.block_table == [2]
    a.num_computed_tokens = 5
    assert kv.allocate_slots(a, 0, num_lookahead_tokens=3) == []     # 8 tokens still fit in 2 blocks
    assert a.block_table == [0, 1]
    assert kv.allocate_slots(a, 0, num_lookahead_tokens=4) == [3]
    assert a.block_table == [0, 1, 3]
    assert kv.pool.num_touched == 4
    kv.free(a)
    kv.free(b)
    assert a.block_table == [] and kv.pool.num_free == 8
    assert kv.pool.ref_counts == [0] * 8


@pytest.mark.parametrize("n,bs,want", [(0, 16, 0), (1, 16, 1), (16, 16, 1), (17, 16, 2), (33, 8, 5)])
def test_blocks_needed(n, bs, want):
    assert blocks_needed(n, bs) == want


def test_freed_blocks_are_reused_least_recently_freed_first_before_fresh_ones():
    pool = BlockPool(8)
    a = pool.allocate(3)
    pool.free([a[2], a[0]])
    assert pool.allocate(3) == [a[2], a[0], 3]
    assert pool.num_touched == 4 and pool.peak_used == 4
