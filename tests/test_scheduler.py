"""Scheduler: queue order, chunked prefill, caps and preemption, asserted exactly (plain Python)."""
import sys

from batchrun.engine.kv_cache import KVCacheManager
from batchrun.engine.scheduler import Scheduler
from batchrun.engine.sequence import Sequence, SeqStatus


def make(kv_blocks=64, block_size=4, max_num_seqs=8, max_tokens=16):
    kv = KVCacheManager(kv_blocks, block_size)
    return Scheduler(kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_tokens, watermark=0.0)


def seq(rid, n):
    return Sequence(rid, list(range(1, n + 1)), None)


def run_step(s: Scheduler, sample_token=7):
    """Apply one schedule as the engine does: computed tokens advance, sampling entries grow by one."""
    out = s.schedule()
    plan = [(e.seq.request_id, e.num_new_tokens, e.samples) for e in out.scheduled]
    for e in out.scheduled:
        samples = e.samples
        e.seq.num_computed_tokens += e.num_new_tokens
        if samples:
            e.seq.token_ids.append(sample_token)
    return plan, out


def test_scheduler_imports_no_torch():
    assert "batchrun.engine.scheduler" in sys.modules
    import subprocess
    code = ("import sys, batchrun.engine.scheduler, batchrun.engine.kv_cache; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_chunked_prefill_mixed_with_decodes_under_token_budget():
    s = make(max_tokens=16)
    a, b = seq("a", 3), seq("b", 30)
    s.add(a)
    s.add(b)
    plan, _ = run_step(s)
    assert plan == [("a", 3, True), ("b", 13, False)]      # b's prefill is cut to the budget
    plan, _ = run_step(s)
    assert plan == [("a", 1, True), ("b", 15, False)]      # a decodes while b continues its prefill
    plan, _ = run_step(s)
    assert plan == [("a", 1, True), ("b", 2, True)]         # b's last chunk samples its first token
    assert b.num_computed_tokens == 30 and b.num_tokens == 31


def test_max_num_seqs_queues_in_arrival_order():
    s = make(max_num_seqs=2, max_tokens=100)
    seqs = [seq(str(i), 2) for i in range(4)]
    for q in seqs:
        s.add(q)
    plan, _ = run_step(s)
    assert [p[0] for p in plan] == ["0", "1"]
    assert [q.request_id for q in s.waiting] == ["2", "3"]
    s.finish(seqs[0], "stop")
    s.remove_finished()
    plan, _ = run_step(s)
    assert [p[0] for p in plan] == ["1", "2"]
    assert s.kv.pool.num_used == len(seqs[1].block_table) + len(seqs[2].block_table)


def test_preempts_newest_and_readmits_it_first_for_recompute():
    # 4 blocks of 4 tokens: two 8-token prompts take 2 blocks each; their 9th token needs a third
    s = make(kv_blocks=4, block_size=4, max_tokens=64)
    a, b = seq("a", 8), seq("b", 8)
    s.add(a)
    s.add(b)
    plan, _ = run_step(s)
    assert plan == [("a", 8, True), ("b", 8, True)]
    assert a.block_table == [0, 1] and b.block_table == [2, 3]
    plan, out = run_step(s)               # both need block 3 of theirs: b (newest) gives way
    assert out.preempted == [b]
    assert plan == [("a", 1, True)]
    assert b.status is SeqStatus.WAITING and b.num_computed_tokens == 0 and b.block_table == []
    assert a.block_table == [0, 1, 3]
    assert list(s.waiting) == [b] and s.num_preemptions == 1
    s.finish(a, "length")
    s.remove_finished()
    plan, _ = run_step(s)
    assert plan == [("b", 9, True)]          # prompt + its sampled token are recomputed
    s.finish(b, "length")
    s.remove_finished()
    assert s.kv.pool.num_free == 4 and not s.has_unfinished()


def test_lone_sequence_preempting_itself_is_not_possible_when_it_fits():
    s = make(kv_blocks=2, block_size=4, max_tokens=64)
    a = seq("a", 7)
    s.add(a)
    for _ in range(2):
        run_step(s)
    assert a.num_tokens == 9 and a.num_computed_tokens == 8 and len(a.block_table) == 2
    plan, out = run_step(s)     # needs a third block that does not exist -> preempts itself
    assert out.preempted == [a] and plan == []


def test_abort_frees_blocks():
    s = make()
    a = seq("a", 9)
    s.add(a)
    run_step(s)
    assert s.kv.pool.num_used == 3
    assert s.abort("a") is a
    assert s.kv.pool.num_used == 0 and a.finish_reason == "abort"
    assert s.abort("missing") is None
