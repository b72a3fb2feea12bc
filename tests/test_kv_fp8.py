"""A float8 KV cache (kv_cache_dtype fp8_e4m3 / fp8_e5m2): every attention path against the reference on the
dequantised K/V (float(code) x scale), the stores against kv_quant.quantize bit for bit, and engines.

Tolerances. The op and the float64 oracle read the same dequantised values; the op folds k_scale into the
query scale and v_scale into the output's normalisation (one extra float32 rounding each), so the float32
tolerance of test_cpu_attention holds, its absolute part taken relative to the outputs' largest magnitude (the
float8 test values span ~10, test_cpu_attention's ~1); bfloat16 q takes the AVX-512 BF16 paths, which round p
to bf16 (the codes are bf16 values exactly): test_cpu_attention's p-rounded bound. The Triton kernels convert the codes to q's dtype
exactly and are held to their own float32 tolerance against their torch references.
"""
import os

import pytest
import torch

from batchrun.kernels import kv_quant as kq
from test_cpu_attention import HEADS, SCENARIOS, TOL, assert_close_p_rounded, make_batch, oracle

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
IDS = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}


def close(out, ref, dtype=torch.float32):
    """assert_close with TOL[dtype], its absolute part relative to ref's largest magnitude (module docstring)."""
    tol = TOL[dtype]
    torch.testing.assert_close(out.double(), ref.double(), rtol=tol["rtol"], atol=tol["atol"] * ref.abs().max().item())


def ca():
    from batchrun.kernels import cpu_attention
    if not cpu_attention.load():
        pytest.skip(f"CPU attention op unavailable: {cpu_attention.status()['error']}")
    return cpu_attention


def fp8_batch(seed, qlens, ctxs, heads, qdtype, kvdtype, ks, vs):
    """make_batch's scattered paged batch with float8 caches: K/V drawn at about 3x the scales (so codes
    span the format's range and the largest values saturate e4m3 at scale 0.25), stored as codes."""
    q, kc, vc, qsl, bt, tables = make_batch(seed, qlens, ctxs, *heads, torch.float32)
    kc8, vc8 = kq.quantize(kc * 3 * ks * 40, kvdtype, ks), kq.quantize(vc * 3 * vs, kvdtype, vs)
    return q.to(qdtype), kc8, vc8, qsl, bt, tables


@pytest.mark.parametrize("kvdtype", FP8, ids=IDS.get)
@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale", [1.0, 0.37, 3.0])
def test_store_op_writes_the_reference_bytes(kvdtype, src, scale):
    g = torch.Generator().manual_seed(3)
    N, bs, H, D = 40, 16, 3, 64
    for T in (5, 300):       # 300: the threaded path
        mag = torch.logspace(-5, 5, T)[:, None, None]     # subnormal codes .. saturation
        k = (torch.randn(T, H, D, generator=g) * mag).to(src)
        v = (torch.randn(T, H, D, generator=g) * mag.flip(0)).to(src)
        k[0, 0, :3] = torch.tensor([float("inf"), -float("inf"), -0.0])
        kc, vc = torch.zeros(N, bs, H, D, dtype=kvdtype), torch.zeros(N, bs, H, D, dtype=kvdtype)
        slots = torch.randperm(N * bs, generator=g)[:T]
        ca().store_kv(k, v, kc, vc, slots, scale, 2 * scale)
        got_k, got_v = kc.view(-1, H, D)[slots], vc.view(-1, H, D)[slots]
        assert torch.equal(got_k.view(torch.uint8), kq.quantize(k, kvdtype, scale).view(torch.uint8))
        assert torch.equal(got_v.view(torch.uint8), kq.quantize(v, kvdtype, 2 * scale).view(torch.uint8))
    assert got_k.float().abs().max() == torch.finfo(kvdtype).max       # inf saturates, never inf or NaN


@pytest.mark.parametrize("kvdtype", FP8, ids=IDS.get)
@pytest.mark.parametrize("isa", ["avx512", "avx2", "baseline"])
def test_op_reads_every_code_exactly(kvdtype, isa):
    """One visible key: the output is that key's value row, so each of the 256 codes comes back as torch's
    float(code) (NaN and inf included), through the vector conversion and, at head_dim 80, its scalar tail."""
    op = ca()
    if isa == "avx512" and op.cpu_isa() != "avx512":
        pytest.skip("no AVX-512 here")
    for D in (64, 80):
        codes = torch.cat([torch.arange(256, dtype=torch.uint8)] * 2)[:4 * D].view(kvdtype).view(4, 1, 1, D)
        q = torch.randn(4, 1, D)
        out = op.paged_attention(q, torch.zeros_like(codes), codes, torch.arange(5, dtype=torch.int32),
                                 torch.ones(4, dtype=torch.int32), torch.arange(4, dtype=torch.int32)[:, None],
                                 0.125, isa=isa, v_scale=1.0)
        torch.testing.assert_close(out, codes.float().view(4, 1, D), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("kvdtype", FP8, ids=IDS.get)
@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"hq{h[0]}-hkv{h[1]}-d{h[2]}")
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_op_matches_oracle_on_dequantised_cache(kvdtype, qdtype, heads, scenario):
    qlens, ctxs = SCENARIOS[scenario]
    ks, vs = (0.25, 2.0) if scenario != "verify" else (1.0, 1.0)
    window = 300 if scenario == "mixed" else None
    q, kc, vc, qsl, bt, tables = fp8_batch(heads[0] * 7 + heads[2], qlens, ctxs, heads, qdtype, kvdtype, ks, vs)
    scale = heads[2] ** -0.5 / 40          # K drawn 40x larger (make_batch's q is ~2): scores stay moderate
    out = ca().paged_attention(q, kc, vc, torch.tensor(qsl, dtype=torch.int32), torch.tensor(ctxs, dtype=torch.int32),
                               bt, scale, window, k_scale=ks, v_scale=vs)
    assert out.dtype == qdtype
    ref, mag = oracle(q, kq.dequantize(kc, ks), kq.dequantize(vc, vs), qsl, ctxs, tables, scale, window,
                      magnitude=True)
    if qdtype == torch.bfloat16:     # the AVX-512 BF16 paths read the codes exactly but round p (module docstring)
        assert_close_p_rounded(out, ref, mag)
    else:
        close(out, ref, qdtype)


@pytest.mark.parametrize("isa", ["avx2", "baseline"])
def test_lower_instruction_sets_agree_on_fp8(isa):
    op = ca()
    qlens, ctxs = [1, 1, 3, 8, 70], [5, 1000, 30, 2000, 300]
    for kvdtype, heads in [(torch.float8_e4m3fn, (9, 3, 64)), (torch.float8_e5m2, (8, 1, 128)),
                           (torch.float8_e4m3fn, (6, 3, 80))]:
        q, kc, vc, qsl, bt, _ = fp8_batch(11, qlens, ctxs, heads, torch.float32, kvdtype, 0.5, 1.5)
        args = (q, kc, vc, torch.tensor(qsl, dtype=torch.int32), torch.tensor(ctxs, dtype=torch.int32), bt, 0.004)
        best = op.paged_attention(*args, k_scale=0.5, v_scale=1.5)
        low = op.paged_attention(*args, isa=isa, k_scale=0.5, v_scale=1.5)
        torch.testing.assert_close(low, best, atol=2e-6 * best.abs().max().item(), rtol=1e-5)


def test_op_refuses_scales_on_a_dense_cache_and_mixed_caches():
    op = ca()
    q, kc, vc, qsl, bt, _ = make_batch(2, [1], [20], 4, 2, 64, torch.float32)
    args = (torch.tensor(qsl, dtype=torch.int32), torch.tensor([20], dtype=torch.int32), bt, 0.1)
    with pytest.raises(RuntimeError, match="float8 caches only"):
        op.paged_attention(q, kc, vc, *args, k_scale=2.0)
    with pytest.raises(RuntimeError, match="dtypes differ"):
        op.paged_attention(q, kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e5m2), *args)


@pytest.mark.parametrize("kvdtype", FP8, ids=IDS.get)
@pytest.mark.parametrize("impl", ["op", "torch"])
def test_torch_backend_stores_and_attends_like_the_reference(kvdtype, impl):
    """The engine's CPU backend, both paths: store_kv writes the reference bytes, forward (decodes, a
    verification query and prefill chunks, SDPA's long path included) equals paged_attention_ref on them."""
    from batchrun.models.attention import AttentionMetadata, TorchAttentionBackend
    if impl == "op":
        ca()
    qlens, ctxs = [1, 1, 5, 40], [30, 700, 60, 40]
    q, kc, vc, qsl, bt, _ = fp8_batch(5, qlens, ctxs, (9, 3, 64), torch.float32, kvdtype, 0.5, 2.0)
    bt = bt.clamp(0, kc.shape[0] - 1)       # the engine pads block tables with real ids; the torch path reads them
    meta = AttentionMetadata(slot_mapping=torch.tensor([3, 17, 40]), query_start_loc=torch.tensor(qsl, dtype=torch.int32),
                             seq_lens=torch.tensor(ctxs, dtype=torch.int32), block_tables=bt, num_decodes=2,
                             max_query_len=40, max_seq_len=700, query_start_loc_host=qsl, seq_lens_host=ctxs)
    be = TorchAttentionBackend(impl)
    k, v = torch.randn(3, 3, 64) * 30, torch.randn(3, 3, 64)
    be.store_kv(k, v, kc, vc, meta, 0.5, 2.0)
    assert torch.equal(kc.view(-1, 3, 64)[meta.slot_mapping].view(torch.uint8),
                       kq.quantize(k, kvdtype, 0.5).view(torch.uint8))
    assert torch.equal(vc.view(-1, 3, 64)[meta.slot_mapping].view(torch.uint8),
                       kq.quantize(v, kvdtype, 2.0).view(torch.uint8))
    out = be.forward(q, kc, vc, meta, 0.004, None, 0.5, 2.0)
    from batchrun.kernels.cpu_attention import paged_attention_ref
    ref = paged_attention_ref(q, kc, vc, meta.query_start_loc, meta.seq_lens, bt, 0.004, None, 0.5, 2.0)
    close(out, ref)
    assert be.impl == impl


triton_only = pytest.mark.skipif(not __import__("batchrun.kernels", fromlist=["HAS_TRITON"]).HAS_TRITON,
                                 reason="Triton not installed")
on_cuda = torch.cuda.is_available()
DEV = "cuda" if on_cuda else "cpu"


@triton_only
@pytest.mark.parametrize("kvdtype", FP8, ids=IDS.get)
@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16])
def test_triton_kernels_read_fp8_like_their_references(kvdtype, qdtype):
    """Decode (one pass and partitioned) and prefill kernels against their torch references on the same
    float8 cache (under TRITON_INTERPRET=1 on CPU: the interpreter's float8 loads are torch's values)."""
    from batchrun.kernels import (paged_decode_attention, paged_decode_attention_ref, paged_prefill_attention,
                                  paged_prefill_attention_ref)
    tol = dict(atol=1e-4, rtol=1e-4) if qdtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    qlens, ctxs = [1, 1, 1], [7, 70, 150]
    q, kc, vc, qsl, bt, _ = fp8_batch(9, qlens, ctxs, (4, 2, 64), qdtype, kvdtype, 0.5, 2.0)
    bt = bt.clamp(0, kc.shape[0] - 1)
    q, kc, vc, bt = (t.to(DEV) for t in (q, kc, vc, bt))
    lens = torch.tensor(ctxs, dtype=torch.int32, device=DEV)
    for part in (64, 512):
        got = paged_decode_attention(q, kc, vc, bt, lens, 0.004, partition_size=part, k_scale=0.5, v_scale=2.0)
        want = paged_decode_attention_ref(q, kc, vc, bt, lens, 0.004, k_scale=0.5, v_scale=2.0)
        torch.testing.assert_close(got.float(), want.float(), **tol)
    qlens, ctxs = [1, 12, 30], [40, 12, 90]
    q, kc, vc, qsl, bt, _ = fp8_batch(10, qlens, ctxs, (4, 2, 64), qdtype, kvdtype, 0.5, 2.0)
    bt = bt.clamp(0, kc.shape[0] - 1)
    q, kc, vc, bt = (t.to(DEV) for t in (q, kc, vc, bt))
    args = (q, kc, vc, torch.tensor(qsl, dtype=torch.int32, device=DEV),
            torch.tensor(ctxs, dtype=torch.int32, device=DEV), bt, 0.004, 30)
    got = paged_prefill_attention(*args, sliding_window=25, k_scale=0.5, v_scale=2.0)
    want = paged_prefill_attention_ref(*args, sliding_window=25, k_scale=0.5, v_scale=2.0)
    torch.testing.assert_close(got.float(), want.float(), **tol)


@triton_only
@pytest.mark.skipif(not on_cuda, reason="the Triton interpreter's float32 -> float8 cast rounds unlike the GPU's "
                                        "cvt.rn.satfinite (e5m2 31.4 -> 16): the store's bytes are checked on CUDA")
@pytest.mark.parametrize("kvdtype", FP8, ids=IDS.get)
def test_triton_store_writes_the_reference_bytes(kvdtype):
    from batchrun.kernels import store_kv, store_kv_ref
    k, v = (torch.randn(50, 2, 64, device=DEV) * torch.logspace(-4, 4, 50, device=DEV)[:, None, None]
            for _ in range(2))
    slots = torch.randperm(8 * 16, device=DEV)[:50]
    a = [torch.zeros(8, 16, 2, 64, dtype=kvdtype, device=DEV) for _ in range(4)]
    store_kv(k, v, a[0], a[1], slots, k_scale=0.5, v_scale=3.0)
    store_kv_ref(k, v, a[2], a[3], slots, k_scale=0.5, v_scale=3.0)
    assert torch.equal(a[0].view(torch.uint8), a[2].view(torch.uint8))
    assert torch.equal(a[1].view(torch.uint8), a[3].view(torch.uint8))
