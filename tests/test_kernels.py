"""batchrun.kernels: every Triton kernel against its torch reference, and each reference against an oracle.

On CPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set here before the kernels are
imported) at small sizes, over a pairwise-covering sample of the sweep axes; on CUDA the same tests run at
fuller size over the full cross-product. The attention references are checked against dense causal
attention over the unpaged K/V in float64.
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
        for name in ("kv_store", "paged_decode", "paged_prefill"):
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
k = torch.randn(2, 1, 8)
kc, vc = torch.zeros(1, 4, 1, 8), torch.zeros(1, 4, 1, 8)
K.store_kv_ref(k, k, kc, vc, torch.tensor([0, 3]))
assert torch.equal(kc[0, 3], k[1])
try:
    K.store_kv(k, k, kc, vc, torch.tensor([0, 3]))
except RuntimeError as e:
    print('ERR', e)
"""
    res = _run_python(code)
    assert res.returncode == 0, res.stderr
    assert "ERR store_kv: Triton is not installed; use store_kv_ref" in res.stdout


@needs_triton
@pytest.mark.skipif(CUDA, reason="checks the CPU-without-interpreter error")
def test_cpu_tensors_without_interpreter_get_a_clear_error():
    code = """
import torch
import batchrun.kernels as K
k = torch.randn(2, 1, 8)
try:
    K.store_kv(k, k, torch.zeros(1, 4, 1, 8), torch.zeros(1, 4, 1, 8), torch.tensor([0, 3]))
except ValueError as e:
    print('ERR', e)
"""
    res = _run_python(code)
    assert res.returncode == 0, res.stderr
    assert "ERR store_kv: tensors are on cpu, Triton kernels need CUDA tensors" in res.stdout
    assert "TRITON_INTERPRET=1" in res.stdout
