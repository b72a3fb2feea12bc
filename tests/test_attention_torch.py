"""The torch attention backend (the CPU path) against a naive per-sequence causal attention over
contiguous K/V, for the batch shapes the runner builds: pure decode steps, and mixes of decodes,
short multi-token queries (speculative verification) and long prefill chunks with cached context.
Both implementations: the compiled op (the default) and the torch path (the reference)."""
import random

import pytest
import torch

from batchrun.models.attention import SHORT_QUERY, AttentionMetadata, TorchAttentionBackend


def naive(q, k, v, scale, window):
    # q: [ql, Hq, D]; k, v: [ctx, Hkv, D]; the queries are the last ql positions
    ql, Hq, D = q.shape
    ctx, Hkv = k.shape[0], k.shape[1]
    k = k.repeat_interleave(Hq // Hkv, 1)
    v = v.repeat_interleave(Hq // Hkv, 1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    qpos = torch.arange(ctx - ql, ctx)[:, None]
    kpos = torch.arange(ctx)[None, :]
    allowed = kpos <= qpos
    if window is not None:
        allowed &= qpos - kpos < window
    s = s.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v.double())


@pytest.mark.parametrize("impl", ["op", "torch"])
@pytest.mark.parametrize("query_lens", [[1, 1, 1], [1, 1, 3, 5, 1 + SHORT_QUERY, 2, 40], [4, 2, 5], [1, 30]])
@pytest.mark.parametrize("window", [None, 7])
def test_torch_backend_matches_naive_attention(query_lens, window, impl):
    torch.manual_seed(0)
    rng = random.Random(1)
    bs, Hq, Hkv, D, N = 8, 8, 2, 16, 64
    k_cache, v_cache = torch.randn(N, bs, Hkv, D), torch.randn(N, bs, Hkv, D)
    free = list(range(N))
    rng.shuffle(free)
    decodes = [n for n in query_lens if n == 1]          # the runner puts one-token queries first
    order = decodes + [n for n in query_lens if n != 1]
    ctx = [n + rng.randint(0 if n > 1 else 1, 37) for n in order]
    tables = [[free.pop() for _ in range(-(-c // bs))] for c in ctx]
    width = max(len(t) for t in tables)
    qsl = [0]
    for n in order:
        qsl.append(qsl[-1] + n)
    q = torch.randn(qsl[-1], Hq, D)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long), query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(ctx, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        num_decodes=len(decodes), max_query_len=max(order), max_seq_len=max(ctx),
        query_start_loc_host=qsl, seq_lens_host=ctx)
    backend = TorchAttentionBackend(impl)
    out = backend.forward(q, k_cache, v_cache, meta, 0.25, window)
    assert backend.impl == impl
    for i, (n, c, t) in enumerate(zip(order, ctx, tables)):
        k = k_cache[t].flatten(0, 1)[:c]
        v = v_cache[t].flatten(0, 1)[:c]
        ref = naive(q[qsl[i]:qsl[i + 1]], k, v, 0.25, window)
        torch.testing.assert_close(out[qsl[i]:qsl[i + 1]].double(), ref, atol=1e-5, rtol=1e-5)


def test_backend_selection():
    assert TorchAttentionBackend("torch").impl == "torch"
    assert TorchAttentionBackend().impl in ("op?", "op")
    assert TorchAttentionBackend().requested == "op"            # the default
    with pytest.raises(ValueError):
        TorchAttentionBackend("fast")


def test_backend_falls_back_to_torch_when_the_op_is_unavailable(monkeypatch):
    from batchrun.kernels import cpu_attention
    monkeypatch.setattr(cpu_attention, "_state", {"tried": True, "ok": False, "error": "no compiler",
                                                  "build_s": None, "path": None})
    backend = TorchAttentionBackend("op")
    q, kc = torch.randn(2, 4, 16), torch.randn(4, 8, 2, 16)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([3, 9]), query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32),
        seq_lens=torch.tensor([4, 2], dtype=torch.int32), block_tables=torch.tensor([[0], [1]], dtype=torch.int32),
        num_decodes=2, max_query_len=1, max_seq_len=4, query_start_loc_host=[0, 1, 2], seq_lens_host=[4, 2])
    k, v = torch.randn(2, 2, 16), torch.randn(2, 2, 16)
    vc = torch.randn_like(kc)
    backend.store_kv(k, v, kc, vc, meta)
    assert torch.equal(kc.view(-1, 2, 16)[9], k[1]) and torch.equal(vc.view(-1, 2, 16)[3], v[0])
    out = backend.forward(q, kc, vc, meta, 0.25, None)
    assert backend.impl == "torch" and out.shape == q.shape
