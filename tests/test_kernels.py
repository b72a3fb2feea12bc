"""batchrun.kernels: every Triton kernel against its torch reference, and each reference against an oracle.

On CPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set here before the kernels are
imported) at small sizes, over a pairwise-covering sample of the sweep axes; on CUDA the same tests run at
fuller size over the full cross-product. The attention references are checked against dense causal
attention over the unpaged K/V in float64, rotary and RMSNorm against transformers.
"""
from __future__ import annotations

import importlib
import itertools
import os
import subprocess
import sys

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"   # must precede the @triton.jit decorations in batchrun.kernels

import pytest  # noqa: E402

import batchrun.kernels as K  # noqa: E402
from batchrun.kernels._common import is_interpreted  # noqa: E402


def _ensure_interpreted():
    # if something imported the kernels before this module set TRITON_INTERPRET, decorate them again
    if not CUDA and K.HAS_TRITON and not is_interpreted(K.paged_decode._decode_kernel):
        for name in ("kv_store", "paged_decode", "paged_prefill", "rmsnorm", "rotary", "activation",
                     "block_copy"):
            importlib.reload(importlib.import_module(f"batchrun.kernels.{name}"))
        importlib.reload(K)


_ensure_interpreted()

DEV = torch.device("cuda" if CUDA else "cpu")
FULL = CUDA
needs_triton = pytest.mark.skipif(not K.HAS_TRITON, reason="triton is not installed")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
HEAD_DIMS = [64, 128]
GQA = [1, 4, 8]
BLOCK_SIZES = [8, 16, 32]
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
       torch.float16: dict(atol=2e-2, rtol=2e-2)}
# Exact where the kernel rounds once like torch. Triton's interpreter truncates fp32 -> bf16 (GPUs round to
# nearest even), so there an exact comparison allows one bf16 ulp.
def exact_tol(dtype):
    return dict(atol=0, rtol=2**-7) if dtype == torch.bfloat16 and not CUDA else dict(atol=0, rtol=0)


JUNK_BLOCK = 2**30   # padding entries of block tables: any read of one would fault or show in the output
NUM_KV_HEADS = 2


def _name(dt):
    return str(dt).replace("torch.", "")


def attention_cases(with_partitions: bool):
    """Full cross-product on CUDA; on CPU an L9 orthogonal array: every pair of (dtype, GQA, block size,
    head-dim/window) values appears once, so every value of every axis is covered."""
    windows = [None, 24]
    parts = ["single", "multi"] if with_partitions else ["single"]
    if FULL:
        return list(itertools.product(DTYPES, GQA, BLOCK_SIZES, HEAD_DIMS, windows, parts))
    levels = [(64, None), (128, None), (64, 24)]
    cases = []
    for a, b in itertools.product(range(3), range(3)):
        d, w = levels[(a + 2 * b) % 3]
        cases.append((DTYPES[a], GQA[b], BLOCK_SIZES[(a + b) % 3], d, w, parts[(3 * a + b) % len(parts)]))
    return cases


def case_id(c):
    dt, g, bs, d, w, p = c
    return f"{_name(dt)}-gqa{g}-bs{bs}-d{d}-w{w}-{p}"


# ---------------------------------------------------------------- paged-cache fixtures and the dense oracle

def paged_cache(kvs, block_size, dtype, gen, spare_blocks=3):
    """Scatter per-sequence unpaged (k, v) [ctx, Hkv, D] into a randomly ordered block pool.

    Unused blocks hold noise (a wrong block read shows), padding table entries hold JUNK_BLOCK."""
    hkv, d = kvs[0][0].shape[1:]
    nblk = [-(-k.shape[0] // block_size) for k, _ in kvs]
    total = sum(nblk) + spare_blocks
    k_cache = torch.randn(total, block_size, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(total, block_size, hkv, d, generator=gen).to(dtype)
    order = torch.randperm(total, generator=gen).tolist()
    width = max(nblk)
    tables = torch.full((len(kvs), width), JUNK_BLOCK, dtype=torch.int32)
    slots, ks, vs = [], [], []
    for i, ((k, v), n) in enumerate(zip(kvs, nblk)):
        ids = [order.pop() for _ in range(n)]
        tables[i, :n] = torch.tensor(ids, dtype=torch.int32)
        slots += [ids[j // block_size] * block_size + j % block_size for j in range(k.shape[0])]
        ks.append(k)
        vs.append(v)
    K.store_kv_ref(torch.cat(ks).to(dtype), torch.cat(vs).to(dtype), k_cache, v_cache,
                   torch.tensor(slots, dtype=torch.int64))
    return k_cache, v_cache, tables


def dense_attention(q, k, v, positions, scale, window):
    """Naive causal attention in float64 over unpaged k, v [ctx, Hkv, D]; q [n, Hq, D] at `positions`."""
    hq, hkv = q.shape[1], k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for r, p in enumerate(positions):
        keys = [j for j in range(k.shape[0]) if j <= p and (window is None or p - j < window)]
        for h in range(hq):
            kh = k[keys, h // (hq // hkv)].double()
            w = torch.softmax((kh @ q[r, h].double()) * scale, dim=0)
            out[r, h] = w @ v[keys, h // (hq // hkv)].double()
    return out


def random_kv(ctx, hkv, d, gen):
    return torch.randn(ctx, hkv, d, generator=gen), torch.randn(ctx, hkv, d, generator=gen)


# ---------------------------------------------------------------- the references are proven first

@pytest.mark.parametrize("gqa,block_size,window", [(1, 8, None), (4, 16, 7), (8, 32, None), (4, 8, 30)])
def test_attention_references_match_dense_attention(gqa, block_size, window):
    gen = torch.Generator().manual_seed(1)
    d, hkv = 32, NUM_KV_HEADS
    hq = gqa * hkv
    scale = 0.3
    # (query length, context length): decode row, whole prompt, chunk after a cached prefix
    shapes = [(1, 19), (11, 11), (6, 29)]
    kvs = [random_kv(ctx, hkv, d, gen) for _, ctx in shapes]
    k_cache, v_cache, tables = paged_cache(kvs, block_size, torch.float32, gen)
    qs = [torch.randn(ql, hq, d, generator=gen) for ql, _ in shapes]
    q = torch.cat(qs)
    qsl = torch.tensor([0] + list(itertools.accumulate(ql for ql, _ in shapes)), dtype=torch.int32)
    lens = torch.tensor([ctx for _, ctx in shapes], dtype=torch.int32)
    got = K.paged_prefill_attention_ref(q, k_cache, v_cache, qsl, lens, tables, scale, 11, window)
    want = torch.cat([dense_attention(qi, k, v, range(ctx - ql, ctx), scale, window)
                      for qi, (k, v), (ql, ctx) in zip(qs, kvs, shapes)])
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)

    # decode reference: the last token of every sequence
    qd = torch.randn(len(shapes), hq, d, generator=gen)
    got = K.paged_decode_attention_ref(qd, k_cache, v_cache, tables, lens, scale, window)
    want = torch.cat([dense_attention(qd[i:i + 1], k, v, [ctx - 1], scale, window)
                      for i, ((k, v), (_, ctx)) in enumerate(zip(kvs, shapes))])
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_store_kv_reference_writes_exactly_the_slots():
    gen = torch.Generator().manual_seed(2)
    k_cache = torch.randn(5, 4, 2, 8, generator=gen)
    v_cache = torch.randn_like(k_cache)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    k, v = torch.randn(6, 2, 8, generator=gen), torch.randn(6, 2, 8, generator=gen)
    slots = torch.tensor([3, -1, 17, 0, -1, 9])
    K.store_kv_ref(k, v, k_cache, v_cache, slots)
    written = set()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(k_cache[s // 4, s % 4], k[t]) and torch.equal(v_cache[s // 4, s % 4], v[t])
            written.add(s)
    for s in set(range(20)) - written:
        assert torch.equal(k_cache[s // 4, s % 4], before_k[s // 4, s % 4])
        assert torch.equal(v_cache[s // 4, s % 4], before_v[s // 4, s % 4])


# ---------------------------------------------------------------- KV store kernel

@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_store_kv_kernel(dtype, d):
    gen = torch.Generator().manual_seed(3)
    T, hkv, bs, nb = (300, 8, 16, 64) if FULL else (13, NUM_KV_HEADS, 8, 6)
    hq = 2 * hkv
    # k, v as views of a fused QKV projection: strided tokens, contiguous head_dim
    qkv = torch.randn(T, (hq + 2 * hkv) * d, generator=gen).to(dtype).to(DEV)
    k = qkv[:, hq * d:(hq + hkv) * d].view(T, hkv, d)
    v = qkv[:, (hq + hkv) * d:].view(T, hkv, d)
    slots = torch.randperm(nb * bs, generator=gen)[:T]
    slots[::4] = -1
    slots = slots.to(DEV)
    caches = [torch.randn(nb, bs, hkv, d, generator=gen).to(dtype).to(DEV) for _ in range(2)]
    ref = [c.clone() for c in caches]
    K.store_kv(k, v, caches[0], caches[1], slots)
    K.store_kv_ref(k, v, ref[0], ref[1], slots)
    assert torch.equal(caches[0], ref[0]) and torch.equal(caches[1], ref[1])

    # a view of the engine's [layers, 2, blocks, ...] tensor is a valid cache
    kv = torch.zeros(2, 2, nb, bs, hkv, d, dtype=dtype, device=DEV)
    K.store_kv(k, v, kv[1, 0], kv[1, 1], slots)
    want_k, want_v = torch.zeros_like(kv[1, 0]), torch.zeros_like(kv[1, 1])
    K.store_kv_ref(k, v, want_k, want_v, slots)
    assert torch.equal(kv[1, 0], want_k) and torch.equal(kv[1, 1], want_v)
    assert not kv[0].any()


# ---------------------------------------------------------------- paged decode

def _decode_problem(dtype, gqa, bs, d, gen, long=False):
    hkv = NUM_KV_HEADS
    if long:
        ctxs = [1100, 700] if not FULL else [4099, 1500, 37]
    elif FULL:
        ctxs = [1, bs - 1, bs + 1, 5 * bs + 3, 300, 509, 64, 37]
    else:
        ctxs = [2 * bs + 3, 1, 70 + bs]           # none a multiple of the block size; > one 64-key partition
    kvs = [random_kv(c, hkv, d, gen) for c in ctxs]
    k_cache, v_cache, tables = paged_cache(kvs, bs, dtype, gen)
    q = torch.randn(len(ctxs), gqa * hkv, d, generator=gen).to(dtype)
    lens = torch.tensor(ctxs, dtype=torch.int32)
    return [t.to(DEV) for t in (q, k_cache, v_cache, tables, lens)]


@needs_triton
@pytest.mark.parametrize("case", attention_cases(with_partitions=True), ids=case_id)
def test_paged_decode_kernel(case):
    dtype, gqa, bs, d, window, parts = case
    gen = torch.Generator().manual_seed(4)
    q, k_cache, v_cache, tables, lens = _decode_problem(dtype, gqa, bs, d, gen)
    scale = d ** -0.5
    psize = 64 if parts == "multi" else K.DEFAULT_PARTITION_SIZE
    bound = tables.shape[1] * bs
    assert (K.num_partitions(bound, psize) > 1) == (parts == "multi")
    got = K.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, window, partition_size=psize)
    want = K.paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, scale, window)
    torch.testing.assert_close(got, want, **TOL[dtype])


@needs_triton
@pytest.mark.parametrize("window", [None, 100])
def test_paged_decode_many_partitions(window):
    """More partitions than the reduction reads per chunk (two chunks of 16)."""
    gen = torch.Generator().manual_seed(5)
    dtype = torch.float32
    q, k_cache, v_cache, tables, lens = _decode_problem(dtype, 4, 16, 64, gen, long=True)
    assert K.num_partitions(tables.shape[1] * 16, 64) > 16
    want = K.paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.125, window)
    got = K.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, window, partition_size=64)
    torch.testing.assert_close(got, want, **TOL[dtype])
    # the max_seq_len hint sets the split; below the real length the last partition takes the rest
    for hint in (int(lens.max()), 200, 1):
        got = K.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, window, partition_size=64,
                                       max_seq_len=hint)
        torch.testing.assert_close(got, want, **TOL[dtype])


# ---------------------------------------------------------------- paged prefill (mixed batches)

def _prefill_problem(dtype, gqa, bs, d, gen):
    hkv = NUM_KV_HEADS
    # (query length, context length): decode rows, whole prompts, chunks after cached prefixes, an idle
    # sequence (0 query tokens), and prompts long enough to span several query tiles of the kernel
    if FULL:
        shapes = [(1, 2 * bs + 3), (1, 333), (150, 150), (97, 97 + 5 * bs + 1), (0, 40), (7, 7),
                  (64, 300), (1, 1), (129, 1000)]
    else:
        shapes = [(1, 2 * bs + 3), (13, 13), (9, 9 + 4 * bs + 1), (0, 5), (37, 37)]
    kvs = [random_kv(ctx, hkv, d, gen) for _, ctx in shapes]
    k_cache, v_cache, tables = paged_cache(kvs, bs, dtype, gen)
    T = sum(ql for ql, _ in shapes)
    q = torch.randn(T, gqa * hkv, d, generator=gen).to(dtype)
    qsl = torch.tensor([0] + list(itertools.accumulate(ql for ql, _ in shapes)), dtype=torch.int32)
    lens = torch.tensor([ctx for _, ctx in shapes], dtype=torch.int32)
    max_q = max(ql for ql, _ in shapes)
    return [t.to(DEV) for t in (q, k_cache, v_cache, qsl, lens, tables)] + [max_q]


@needs_triton
@pytest.mark.parametrize("case", attention_cases(with_partitions=False), ids=case_id)
def test_paged_prefill_kernel(case):
    dtype, gqa, bs, d, window, _ = case
    gen = torch.Generator().manual_seed(6)
    q, k_cache, v_cache, qsl, lens, tables, max_q = _prefill_problem(dtype, gqa, bs, d, gen)
    scale = d ** -0.5
    got = K.paged_prefill_attention(q, k_cache, v_cache, qsl, lens, tables, scale, max_q, window)
    want = K.paged_prefill_attention_ref(q, k_cache, v_cache, qsl, lens, tables, scale, max_q, window)
    torch.testing.assert_close(got, want, **TOL[dtype])


@needs_triton
def test_prefill_kernel_serves_decode_rows_like_decode_kernel():
    gen = torch.Generator().manual_seed(7)
    q, k_cache, v_cache, tables, lens = _decode_problem(torch.float32, 4, 16, 64, gen)
    B = q.shape[0]
    qsl = torch.arange(B + 1, dtype=torch.int32, device=DEV)
    a = K.paged_prefill_attention(q, k_cache, v_cache, qsl, lens, tables, 0.1, 1, 24)
    b = K.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.1, 24)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- RMSNorm

def test_rms_norm_reference_matches_transformers():
    tf = pytest.importorskip("transformers.models.llama.modeling_llama")
    gen = torch.Generator().manual_seed(8)
    for dtype in DTYPES:
        norm = tf.LlamaRMSNorm(96, eps=1e-5).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(torch.rand(96, generator=gen) + 0.5)
        x = torch.randn(7, 96, generator=gen).to(dtype)
        r = torch.randn(7, 96, generator=gen).to(dtype)
        with torch.no_grad():
            torch.testing.assert_close(K.rms_norm_ref(x, norm.weight.detach(), 1e-5), norm(x), atol=0, rtol=0)
            normed, new_res = K.fused_add_rms_norm_ref(x, r, norm.weight.detach(), 1e-5)
            torch.testing.assert_close(new_res, x + r, atol=0, rtol=0)
            torch.testing.assert_close(normed, norm(x + r), atol=0, rtol=0)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("hidden", [96, 256])
def test_rms_norm_kernels(dtype, hidden):
    gen = torch.Generator().manual_seed(9)
    T = 257 if FULL else 5
    hidden = hidden * 16 if FULL else hidden
    x = torch.randn(T, hidden, generator=gen).to(dtype).to(DEV)
    r = torch.randn(T, hidden, generator=gen).to(dtype).to(DEV)
    w = (torch.rand(hidden, generator=gen) + 0.5).to(dtype).to(DEV)
    tol = TOL[dtype]
    torch.testing.assert_close(K.rms_norm(x, w, 1e-6), K.rms_norm_ref(x, w, 1e-6), **tol)
    # a row-strided input (a slice of a wider tensor)
    wide = torch.randn(T, hidden + 32, generator=gen).to(dtype).to(DEV)
    xs = wide[:, :hidden]
    torch.testing.assert_close(K.rms_norm(xs, w, 1e-6), K.rms_norm_ref(xs, w, 1e-6), **tol)

    want_n, want_r = K.fused_add_rms_norm_ref(x, r, w, 1e-6)
    got_n, got_r = K.fused_add_rms_norm(x, r, w, 1e-6)
    torch.testing.assert_close(got_r, want_r, **exact_tol(dtype))   # one rounding of an fp32 sum
    torch.testing.assert_close(got_n, want_n, **tol)
    xi, ri = x.clone(), r.clone()
    got_n, got_r = K.fused_add_rms_norm(xi, ri, w, 1e-6, inplace=True)
    assert got_n.data_ptr() == xi.data_ptr() and got_r.data_ptr() == ri.data_ptr()
    torch.testing.assert_close(ri, want_r, **exact_tol(dtype))
    torch.testing.assert_close(xi, want_n, **tol)


# ---------------------------------------------------------------- rotary

def _hf_rope_config(head_dim, rope_scaling):
    from transformers import LlamaConfig
    return LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                       max_position_embeddings=4096, rope_theta=500000.0, rope_scaling=rope_scaling)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("scaling", [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
    {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 128},
    {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
     "original_max_position_embeddings": 1024},
], ids=["default", "linear", "llama3.1", "llama3-short", "llama3-wide"])
def test_rope_inv_freq_matches_transformers(head_dim, scaling):
    pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    cfg = _hf_rope_config(head_dim, scaling)
    ours = K.rope_inv_freq(head_dim, 500000.0, scaling)
    if scaling is not None:
        theirs, attn_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](cfg, "cpu")
        assert attn_factor == 1.0
        torch.testing.assert_close(ours, theirs, atol=0, rtol=1e-6)
        if scaling["rope_type"] == "llama3":   # every case has kept, slowed and interpolated frequencies
            ratio = K.rope_inv_freq(head_dim, 500000.0) / ours
            factor = scaling["factor"]
            assert (ratio < 1.0001).any() and (ratio > factor * 0.9999).any()
            assert ((ratio > 1.0001) & (ratio < factor * 0.9999)).any()
    # the cos/sin cache against HF's rotary module (cos/sin duplicated over both halves there)
    rot = LlamaRotaryEmbedding(cfg)
    pos = torch.tensor([[0, 1, 7, 100, 3000]])
    cos, sin = rot(torch.zeros(1, 5, head_dim), pos)
    cache = K.rope_cos_sin_cache(ours, 3001)[pos[0]]
    half = head_dim // 2
    torch.testing.assert_close(cache[:, :half], cos[0, :, :half], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache[:, half:], sin[0, :, :half], atol=1e-5, rtol=1e-5)


def test_rotary_reference_matches_transformers():
    tf = pytest.importorskip("transformers.models.llama.modeling_llama")
    gen = torch.Generator().manual_seed(10)
    d, T = 64, 9
    cache = K.rope_cos_sin_cache(K.rope_inv_freq(d, 10000.0), 512)
    pos = torch.randint(0, 512, (T,), generator=gen)
    q, k = torch.randn(T, 4, d, generator=gen), torch.randn(T, 2, d, generator=gen)
    cos = torch.cat([cache[pos, :d // 2]] * 2, dim=-1)
    sin = torch.cat([cache[pos, d // 2:]] * 2, dim=-1)
    want_q, want_k = tf.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
    got_q, got_k = K.rotary_embedding_ref(q, k, pos, cache)
    torch.testing.assert_close(got_q, want_q, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got_k, want_k, atol=1e-6, rtol=1e-6)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("layout", ["cat", "pair", "partial"])
def test_rotary_kernel(dtype, d, layout):
    gen = torch.Generator().manual_seed(11)
    T, hq, hkv = (300, 32, 8) if FULL else (6, 4, NUM_KV_HEADS)
    rot_dim = d // 2 if layout == "partial" else d
    cache = K.rope_cos_sin_cache(K.rope_inv_freq(rot_dim, 10000.0, {"rope_type": "linear", "factor": 2.0}),
                                 2048).to(DEV)
    cs = cache.chunk(2, dim=-1) if layout == "pair" else cache
    if layout == "pair":
        cs = tuple(c.contiguous() for c in cs)
    pos = torch.randint(0, 2048, (T,), generator=gen).to(DEV)
    # q and k as views of a fused QKV tensor
    qkv = torch.randn(T, (hq + 2 * hkv) * d, generator=gen).to(dtype).to(DEV)
    q = qkv[:, :hq * d].view(T, hq, d)
    k = qkv[:, hq * d:(hq + hkv) * d].view(T, hkv, d)
    want_q, want_k = K.rotary_embedding_ref(q, k, pos, cs)
    got_q, got_k = K.rotary_embedding(q, k, pos, cs)
    torch.testing.assert_close(got_q, want_q, **TOL[dtype])
    torch.testing.assert_close(got_k, want_k, **TOL[dtype])
    got_q, none = K.rotary_embedding(q, None, pos.int(), cs)
    assert none is None
    torch.testing.assert_close(got_q, want_q, **TOL[dtype])
    untouched = qkv[:, (hq + hkv) * d:].clone()
    K.rotary_embedding(q, k, pos, cs, inplace=True)
    torch.testing.assert_close(q, want_q, **TOL[dtype])
    torch.testing.assert_close(k, want_k, **TOL[dtype])
    assert torch.equal(qkv[:, (hq + hkv) * d:], untouched)      # v is not touched


# ---------------------------------------------------------------- SiLU and mul

@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("inter", [96, 1100])
def test_silu_and_mul_kernel(dtype, inter):
    gen = torch.Generator().manual_seed(12)
    T = 300 if FULL else 3
    x = torch.randn(T, 2 * inter, generator=gen).to(dtype).to(DEV)
    want = K.silu_and_mul_ref(x)
    gate, up = x.double().chunk(2, dim=-1)
    torch.testing.assert_close(want.double(), gate * torch.sigmoid(gate) * up, **TOL[dtype])   # ref vs formula
    torch.testing.assert_close(K.silu_and_mul(x), want, **TOL[dtype])
    out = torch.empty(T, inter, dtype=dtype, device=DEV)
    assert K.silu_and_mul(x, out=out) is out
    torch.testing.assert_close(out, want, **TOL[dtype])


# ---------------------------------------------------------------- block copies

def _pool(num_blocks, gen, dtype=torch.float16, device=DEV, pin=False):
    shape = (3, 2, num_blocks, 8, NUM_KV_HEADS, 16) if not FULL else (8, 2, num_blocks, 16, 8, 128)
    t = torch.randn(shape, generator=gen).to(dtype)
    if pin:
        t = t.pin_memory()
    return t.to(device)


def test_copy_blocks_reference_moves_whole_blocks():
    gen = torch.Generator().manual_seed(13)
    pool = _pool(10, gen, device="cpu")
    before = pool.clone()
    src, dst = [1, 4, 4], [7, 0, 9]
    K.copy_blocks_ref(pool, src, dst)
    for s, d in zip(src, dst):
        assert torch.equal(pool[:, :, d], before[:, :, s])
    others = [b for b in range(10) if b not in dst]
    assert torch.equal(pool[:, :, others], before[:, :, others])


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_copy_blocks_kernel(dtype):
    gen = torch.Generator().manual_seed(14)
    pool = _pool(12, gen, dtype)
    ref = pool.clone()
    src, dst = [2, 5, 5, 11], torch.tensor([0, 7, 8, 3], dtype=torch.int32)
    K.copy_blocks(pool, src, dst)
    K.copy_blocks_ref(ref, src, dst)
    assert torch.equal(pool, ref)
    K.copy_blocks(pool, [], [])
    assert torch.equal(pool, ref)


def test_swap_blocks_between_pools():
    """Batched gather/scatter against the one-block-at-a-time reference, out to a host pool and back."""
    gen = torch.Generator().manual_seed(15)
    device_pool = _pool(9, gen)
    host_pool = _pool(6, gen, device="cpu", pin=CUDA)
    host_ref = host_pool.clone()
    K.swap_blocks(device_pool, host_pool, [8, 2, 5], [0, 4, 1])
    K.swap_blocks_ref(device_pool.cpu(), host_ref, [8, 2, 5], [0, 4, 1])
    assert torch.equal(host_pool, host_ref)
    dev_ref = device_pool.cpu()
    K.swap_blocks(host_pool, device_pool, [4, 0], [3, 6])
    K.swap_blocks_ref(host_pool, dev_ref, [4, 0], [3, 6])
    if CUDA:
        torch.cuda.synchronize()
    assert torch.equal(device_pool.cpu(), dev_ref)
    assert torch.equal(device_pool[:, :, 3].cpu(), host_pool[:, :, 4])


# ---------------------------------------------------------------- clear errors

def _attn_inputs(dtype=torch.float32):
    gen = torch.Generator().manual_seed(16)
    q, k_cache, v_cache, tables, lens = _decode_problem(dtype, 2, 8, 32, gen)
    return q, k_cache, v_cache, tables, lens


def _bad_calls():
    q, kc, vc, bt, lens = _attn_inputs()
    B = q.shape[0]
    qsl = torch.arange(B + 1, dtype=torch.int32, device=DEV)
    k = torch.randn(4, NUM_KV_HEADS, 32, device=DEV)
    slots = torch.arange(4, device=DEV)
    x = torch.randn(3, 16, device=DEV)
    w = torch.ones(16, device=DEV)
    cache = K.rope_cos_sin_cache(K.rope_inv_freq(32, 10000.0), 64).to(DEV)
    pool = torch.zeros(2, 2, 4, 8, 2, 16, device=DEV)
    yield "k_cache must be contiguous", lambda: K.paged_decode_attention(
        q, kc.transpose(1, 2).contiguous().transpose(1, 2), vc, bt, lens, 0.1)
    yield "seq_lens must have dtype int32", lambda: K.paged_decode_attention(q, kc, vc, bt, lens.long(), 0.1)
    yield "q must have dtype float32", lambda: K.paged_decode_attention(q.half(), kc, vc, bt, lens, 0.1)
    yield "multiple of num KV heads", lambda: K.paged_decode_attention(q[:, :3], kc, vc, bt, lens, 0.1)
    yield r"block_tables must have shape \[3, \*\]", lambda: K.paged_decode_attention(q, kc, vc, bt[:2], lens, 0.1)
    yield "scale must be a positive", lambda: K.paged_decode_attention(q, kc, vc, bt, lens, -1.0)
    yield "sliding_window must be None", lambda: K.paged_decode_attention(q, kc, vc, bt, lens, 0.1, 0)
    yield r"q must have shape \[3, \*, 32\]", lambda: K.paged_decode_attention(q[..., :16], kc, vc, bt, lens, 0.1)
    yield "partition_size", lambda: K.paged_decode_attention(q, kc, vc, bt, lens, 0.1, partition_size=48)
    yield r"query_start_loc must have shape \[4\]", lambda: K.paged_prefill_attention(
        q, kc, vc, qsl[:-1], lens, bt, 0.1, 1)
    # value checks run on CPU inputs only (no device sync), before the device check
    yield "max_query_len=0 is below", lambda: K.paged_prefill_attention(
        q.cpu(), kc.cpu(), vc.cpu(), qsl.cpu(), lens.cpu(), bt.cpu(), 0.1, 0)
    yield "slot_mapping must have dtype int64", lambda: K.store_kv(k, k, kc, vc, slots.int())
    yield r"v must have shape \[4, 2, 32\]", lambda: K.store_kv(k, k[:, :1], kc, vc, slots)
    yield "contiguous last dimension", lambda: K.store_kv(k.transpose(1, 2).contiguous().transpose(1, 2),
                                                          k, kc, vc, slots)
    yield r"weight must have shape \[16\]", lambda: K.rms_norm(x, w[:8], 1e-6)
    yield "eps must be a positive", lambda: K.rms_norm(x, w, 0.0)
    yield "residual must have dtype float32", lambda: K.fused_add_rms_norm(x, x.half(), w, 1e-6)
    yield "rotary dim 32", lambda: K.rotary_embedding(q[:, :, :16].contiguous(), None,
                                                      torch.zeros(B, dtype=torch.long, device=DEV), cache)
    yield r"positions must have shape \[3\]", lambda: K.rotary_embedding(
        q, None, torch.zeros(2, dtype=torch.long, device=DEV), cache)
    yield "even last dim", lambda: K.silu_and_mul(torch.randn(2, 5, device=DEV))
    yield "kv_pool must be 6-D", lambda: K.copy_blocks(pool[0], [0], [1])
    yield "both a source and a destination", lambda: K.copy_blocks(pool, [0, 1], [1, 2])
    yield "dst_block_ids repeat", lambda: K.copy_blocks(pool, [0, 1], [2, 2])
    yield r"dst_block_ids must lie in \[0, 4\)", lambda: K.copy_blocks(pool, [0], [4])
    yield "differ in length", lambda: K.swap_blocks(pool, pool.clone(), [0, 1], [2])
    yield "pools differ in more than num_blocks", lambda: K.swap_blocks(pool, pool[:1].clone(), [0], [0])


def _host_value_checks():
    q, kc, vc, bt, lens = (t.cpu() for t in _attn_inputs())
    bad_bt = bt.clone()
    bad_bt[0, 0] = kc.shape[0]
    yield r"block_tables entries in use must lie in \[0, ", lambda: K.paged_decode_attention_ref(
        q, kc, vc, bad_bt, lens, 0.1)
    long = lens.clone()
    long[1] = bt.shape[1] * 8 + 1
    yield "seq_lens must lie in", lambda: K.paged_decode_attention_ref(q, kc, vc, bt, long, 0.1)
    qsl = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    yield "sequence 1 has 2 query tokens", lambda: K.paged_prefill_attention_ref(
        q, kc, vc, torch.tensor([0, 1, 3, 3], dtype=torch.int32), torch.tensor([5, 1, 9], dtype=torch.int32),
        bt, 0.1, 2)
    yield "query_start_loc must rise", lambda: K.paged_prefill_attention_ref(
        q, kc, vc, torch.tensor([0, 2, 1, 3], dtype=torch.int32), lens, bt, 0.1, 3)
    yield "max_query_len=0 is below", lambda: K.paged_prefill_attention_ref(q, kc, vc, qsl, lens, bt, 0.1, 0)
    yield r"slot_mapping values must lie in \[-1, ", lambda: K.store_kv_ref(
        q[:, :2], q[:, :2], kc, vc, torch.tensor([0, 1, 10**6]))
    yield "needs key 'factor'", lambda: K.rope_inv_freq(64, 1e4, {"rope_type": "llama3"})
    yield "not supported", lambda: K.rope_inv_freq(64, 1e4, {"rope_type": "yarn", "factor": 2.0})
    yield r"positions values must lie in \[0, 8\)", lambda: K.rotary_embedding_ref(
        q, None, torch.tensor([0, 8, 1]), K.rope_cos_sin_cache(K.rope_inv_freq(32, 1e4), 8))


BAD_CALLS = list(_bad_calls())
BAD_VALUES = list(_host_value_checks())


@needs_triton
@pytest.mark.parametrize("match,call", BAD_CALLS, ids=[m for m, _ in BAD_CALLS])
def test_launchers_reject_bad_inputs(match, call):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("match,call", BAD_VALUES, ids=[m for m, _ in BAD_VALUES])
def test_references_reject_bad_values(match, call):
    with pytest.raises(ValueError, match=match):
        call()


# ---------------------------------------------------------------- import without Triton / outside the interpreter

def _run_python(code: str, **env_changes) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(env_changes)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_references_work_without_triton():
    code = """
import sys
sys.modules['triton'] = None          # `import triton` now raises ImportError
import torch
import batchrun.kernels as K
assert K.HAS_TRITON is False
x = torch.randn(2, 8)
assert K.silu_and_mul_ref(x).shape == (2, 4)
try:
    K.silu_and_mul(x)
except RuntimeError as e:
    print('ERR', e)
"""
    res = _run_python(code)
    assert res.returncode == 0, res.stderr
    assert "ERR silu_and_mul: Triton is not installed; use silu_and_mul_ref" in res.stdout


@needs_triton
@pytest.mark.skipif(CUDA, reason="checks the CPU-without-interpreter error")
def test_cpu_tensors_without_interpreter_get_a_clear_error():
    code = """
import torch
import batchrun.kernels as K
try:
    K.rms_norm(torch.randn(2, 8), torch.ones(8), 1e-6)
except ValueError as e:
    print('ERR', e)
"""
    res = _run_python(code)
    assert res.returncode == 0, res.stderr
    assert "ERR rms_norm: tensors are on cpu, Triton kernels need CUDA tensors" in res.stdout
    assert "TRITON_INTERPRET=1" in res.stdout
