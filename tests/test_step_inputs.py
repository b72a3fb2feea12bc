"""StepInputs: the decode-only fast path gives exactly the general path's inputs and metadata (its reference),
and the dispatch takes the fast path only for steps of single-token, draft-free entries."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from batchrun.engine.scheduler import ScheduledSeq
from batchrun.engine.sequence import Sequence
from batchrun.engine.step_inputs import StepInputs

BS = 16


def _inputs(max_num_seqs=8, max_num_batched_tokens=64) -> StepInputs:
    cfg = SimpleNamespace(block_size=BS, max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs)
    return StepInputs(cfg, torch.device("cpu"), max_model_len=4096)


def _decoding(rng: random.Random, n: int, used: set) -> ScheduledSeq:
    """A sequence of n tokens whose last one is this step's query, on distinct random blocks."""
    seq = Sequence(f"r{rng.random()}", [rng.randrange(3, 1000) for _ in range(n)], params=None)
    seq.num_computed_tokens = n - 1
    free = [b for b in range(1, 4096) if b not in used]
    seq.block_table = rng.sample(free, -(-n // BS))
    used.update(seq.block_table)
    return ScheduledSeq(seq, 1)


def _as_lists(out):
    ids, pos, m = out
    return (ids.tolist(), pos.tolist(), m.slot_mapping.tolist(), m.query_start_loc.tolist(), m.seq_lens.tolist(),
            m.block_tables.tolist(), m.num_decodes, m.max_query_len, m.max_seq_len, m.query_start_loc_host,
            m.seq_lens_host, m.slot_mapping.dtype, m.query_start_loc.dtype, m.seq_lens.dtype, m.block_tables.dtype,
            ids.dtype, pos.dtype)


@pytest.mark.parametrize("batch", [1, 2, 7, 64])
def test_decode_fast_path_equals_the_general_path(batch):
    rng = random.Random(batch)
    inputs, ref = _inputs(), _inputs()
    for step in range(5):                   # the buffers grow and are reused across steps
        used: set = set()
        entries = [_decoding(rng, rng.choice([1, 15, 16, 17, 33, rng.randrange(1, 900)]), used)
                   for _ in range(batch)]
        assert _as_lists(inputs._prepare_decodes(entries)) == _as_lists(ref._prepare_mixed(entries))


def test_slots_are_where_each_query_token_lives():
    rng = random.Random(0)
    entries = [_decoding(rng, n, set()) for n in (1, 16, 17, 40)]
    _, pos, meta = _inputs().prepare(entries)
    for e, p, s in zip(entries, pos.tolist(), meta.slot_mapping.tolist()):
        assert p == e.seq.num_computed_tokens
        assert s == e.seq.block_table[p // BS] * BS + p % BS


def test_dispatch_takes_the_fast_path_only_for_plain_decodes(monkeypatch):
    rng = random.Random(1)
    calls = []
    inputs = _inputs()
    monkeypatch.setattr(inputs, "_prepare_decodes", lambda es: calls.append("decodes") or ("d", None, None))
    monkeypatch.setattr(inputs, "_prepare_mixed", lambda es: calls.append("mixed") or ("m", None, None))
    used: set = set()
    decodes = [_decoding(rng, 20, used) for _ in range(3)]
    inputs.prepare(decodes)
    prefill = ScheduledSeq(Sequence("p", list(range(3, 40)), params=None), 37)
    inputs.prepare(decodes + [prefill])
    drafted = ScheduledSeq(decodes[0].seq, 3, draft=[5, 6])
    inputs.prepare([drafted] + decodes[1:])
    inputs.prepare([])
    assert calls == ["decodes", "mixed", "mixed", "mixed"]
