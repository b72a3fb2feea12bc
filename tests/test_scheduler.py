"""Scheduler: queue order, chunked prefill, caps and preemption, asserted exactly (plain Python)."""
import sys

from batchrun.engine.kv_cache import KVCacheManager
from batchrun.engine.scheduler import Scheduler
from batchrun.engine.sequence import Sequence, SeqStatus
from batchrun.outputs import SamplingParams


def make(kv_blocks=64, block_size=4, max_num_seqs=8, max_tokens=16):
    kv = KVCacheManager(kv_blocks, block_size, watermark=0.0)
    return Scheduler(kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_tokens)


def seq(rid, n, max_tokens=10**6):
    return Sequence(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def run_step(s: Scheduler, sample_token=7):
    """One step as the engine runs it: schedule, then the scheduler's own update with one sampled token for
    each entry that reaches its sequence's end."""
    out = s.schedule()
    plan = [(e.seq.request_id, e.num_new_tokens, e.samples) for e in out.scheduled]
    s.update(out, {id(e): [sample_token] for e in out.scheduled if e.samples}, now=0.0)
    return plan, out


def test_scheduler_imports_no_torch():
    assert "batchrun.engine.scheduler" in sys.modules
    import subprocess
    code = ("import sys, batchrun.engine.scheduler, batchrun.engine.kv_cache, batchrun.engine.speculative; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_scheduler_asks_the_kv_manager_and_never_touches_a_block_pool():
    import ast
    import batchrun.engine.scheduler as mod
    tree = ast.parse(open(mod.__file__, encoding="utf-8").read())
    touched = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)} & {"pool", "host_pool"}
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert not touched and "BlockPool" not in names


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


def test_swap_out_on_preemption_and_swap_in_before_admission():
    kv = KVCacheManager(4, 4, watermark=0.0, num_host_blocks=8)
    s = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64, swap_min_tokens=4)
    a, b = seq("a", 8), seq("b", 8)
    s.add(a)
    s.add(b)
    run_step(s)
    c = seq("c", 2)
    s.add(c)
    plan, out = run_step(s)
    assert out.preempted == [b] and out.swap_out == [(2, 0), (3, 1)]
    assert b.status is SeqStatus.SWAPPED and b.host_blocks == [0, 1] and b.num_computed_tokens == 8
    assert plan == [("a", 1, True)]          # nothing admitted while b waits to swap back in
    assert kv.swapped_out_blocks == 2 and s.recomputed_tokens == 0
    s.finish(a, "length")
    s.remove_finished()
    plan, out = run_step(s)
    assert out.swap_in == [(0, 2), (1, 3)]   # free pool order: b's old blocks, then what a freed
    assert b.block_table == [2, 3, 1] and kv.host_pool.num_free == 8   # + a block for its next token
    assert plan == [("b", 1, True), ("c", 2, True)]     # swapped back in, decodes; then c is admitted


def test_short_sequences_are_recomputed_not_swapped():
    kv = KVCacheManager(4, 4, watermark=0.0, num_host_blocks=8)
    s = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64, swap_min_tokens=100)
    a, b = seq("a", 8), seq("b", 8)
    s.add(a)
    s.add(b)
    run_step(s)
    _, out = run_step(s)
    assert out.preempted == [b] and out.swap_out == []
    assert b.status is SeqStatus.WAITING and s.recomputed_tokens == 8


def test_swapped_in_sequence_can_be_swapped_out_again_in_the_same_step():
    """The runner copies swap-ins before swap-outs, because the scheduler may emit both for one sequence."""
    kv = KVCacheManager(4, 4, watermark=0.0, num_host_blocks=4)
    s = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64, swap_min_tokens=0)
    a = seq("a", 16)                  # mid-prefill: 8 of 16 computed, its next chunk needs 2 more blocks
    assert kv.allocate_slots(a, 8) == [0, 1]
    a.num_computed_tokens, a.status = 8, SeqStatus.RUNNING
    s.running.append(a)
    b = seq("b", 3)                   # swapped out earlier: device block 2 -> host block 0
    assert kv.allocate_slots(b, 3) == [2]
    b.num_computed_tokens = 3
    assert kv.swap_out(b) == [(2, 0)]
    b.status = SeqStatus.SWAPPED
    s.swapped.append(b)
    out = s.schedule()
    assert out.swap_in == [(0, 2)]                 # b comes back (2 free blocks >= its 1 + 1)...
    # ...and gives way to a at once, into the host block its swap-in just freed (used blocks are reused
    # first): the runner must copy host 0 -> device 2 before device 2 -> host 0
    assert out.preempted == [b] and out.swap_out == [(2, 0)]
    assert [(e.seq.request_id, e.num_new_tokens) for e in out.scheduled] == [("a", 8)]
    assert a.block_table == [0, 1, 2, 3] and b.host_blocks == [0] and kv.host_pool.num_free == 3


def test_update_stops_on_max_tokens_a_stop_token_and_eos_and_releases_blocks():
    kv = KVCacheManager(64, 4, watermark=0.0)
    s = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64, eos_token_ids=[5])
    a = seq("a", 3, max_tokens=2)
    b = Sequence("b", [1, 2, 3], SamplingParams(max_tokens=100, stop_token_ids=[9], ignore_eos=True))
    c = Sequence("c", [1, 2, 3], SamplingParams(max_tokens=100))           # stops at EOS
    for q in (a, b, c):
        s.add(q)
    out = s.schedule()
    assert s.update(out, {id(e): [7] for e in out.scheduled}, now=1.0) == []
    out = s.schedule()
    tokens = {"a": [7], "b": [5], "c": [5]}                                  # b ignores EOS, c does not
    finished = s.update(out, {id(e): tokens[e.seq.request_id] for e in out.scheduled}, now=2.0)
    assert [(q.request_id, q.finish_reason, q.finish_time) for q in finished] == [("a", "length", 2.0),
                                                                               ("c", "stop", 2.0)]
    assert s.running == [b] and b.first_token_time == 1.0
    out = s.schedule()
    assert [q.finish_reason for q in s.update(out, {id(out.scheduled[0]): [9]}, now=3.0)] == ["stop"]
    assert not s.has_unfinished() and kv.pool.num_free == 64
    assert b.output_token_ids == [7, 5, 9]


def test_update_keeps_accepted_drafts_and_trims_the_rejected_ones():
    kv = KVCacheManager(64, 4, watermark=0.0)
    s = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64)
    a = seq("a", 6)
    s.add(a)
    run_step(s)                                  # prefill: 6 computed, 7 tokens
    a.draft = [11, 12, 13, 14]
    out = s.schedule()
    assert [(e.num_new_tokens, e.draft) for e in out.scheduled] == [(5, [11, 12, 13, 14])]
    assert len(a.block_table) == 3               # room for 7 + 4 tokens
    s.update(out, {id(out.scheduled[0]): [11, 12, 99]}, now=0.0)            # two drafts accepted
    assert a.token_ids[6:] == [7, 11, 12, 99] and a.num_computed_tokens == 9
    assert len(a.block_table) == 3 and s.counters["spec_proposed"] == 4 and s.counters["spec_accepted"] == 2
    a.draft = [1, 2, 3, 4]
    out = s.schedule()
    s.update(out, {id(out.scheduled[0]): [8]}, now=0.0)                     # every draft rejected
    assert a.num_computed_tokens == 10 and a.num_tokens == 11 and len(a.block_table) == 3   # trimmed from 4
