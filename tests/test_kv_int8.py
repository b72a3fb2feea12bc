"""An int8 KV cache (kv_cache_dtype int8: codes and a float16 scale per 32 values of each head's row, inline):
the quantiser against a naive per-group loop, the store op against it bit for bit, every attention path
against the float64 oracle on the dequantised rows, and engines (the op engine against the reference one:
test_kv_fp8_engine, parametrized over int8). The generic loops read exactly those values
(float(code) x float16 scale is exact in float32), so test_cpu_attention's tolerances hold; the AVX-512 BF16
paths read them rounded to bfloat16 and must then equal the bf16 cache's kernel on the rounded rows bit for
bit (and the oracle on them within test_cpu_attention's p-rounded bound).
"""
import math

import pytest
import torch

from batchrun import LLM
from batchrun.kernels import kv_quant as kq
from batchrun.models.loader import inspect_model
from test_cpu_attention import HEADS, SCENARIOS, assert_close_p_rounded, make_batch, oracle
from test_kv_fp8 import ca, close
from test_job_common import tiny_model  # noqa: F401 - fixture
from test_kv_fp8_engine import kv_budget

I8 = torch.int8


def naive_rows(x: torch.Tensor) -> list:
    """x [R, D] as cache rows, one value at a time in Python floats rounded to float32 where the format says."""
    f32 = lambda a: torch.tensor(a, dtype=torch.float32).item()         # noqa: E731
    rows = []
    for row in x.float().tolist():
        codes, scales = [], []
        for g0 in range(0, len(row), 32):
            grp = row[g0:g0 + 32]
            s = torch.tensor(min(f32(max(abs(a) for a in grp) / 127), 65504.0)).half()
            sf = s.item()
            inv = f32(1.0 / sf) if sf > 0 else 0.0
            codes += [max(-127, min(127, round(f32(a * inv)))) for a in grp]    # round(): half to even
            scales.append(s)
        rows.append(torch.cat([torch.tensor(codes, dtype=I8), torch.stack(scales).view(I8)]))
    return rows


@pytest.mark.parametrize("D", [16, 64, 80, 128])
def test_quantiser_matches_a_naive_loop_and_its_error_bound(D):
    g = torch.Generator().manual_seed(D)
    mag = torch.logspace(-6, 6, 24)[:, None]                   # tiny scales (float16 subnormals) .. large
    x = torch.randn(24, D, generator=g) * mag
    x[0] = 0.0                                                 # an all-zero group: scale 0, codes 0
    x[1, 5] = 3e9                                              # past float16's range: the scale saturates
    c = kq.quantize_int8(x)
    assert c.dtype == I8 and c.shape == (24, kq.row_width(I8, D)) == (24, D + 2 * math.ceil(D / 32))
    assert torch.equal(c, torch.stack(naive_rows(x)))
    back = kq.dequantize(c)
    assert back.shape == x.shape and torch.equal(back[0], torch.zeros(D))
    # half a step of the group's scale where the scale is a normal float16 (below, its subnormals lose bits)
    s = c[:, D:].contiguous().view(torch.float16).float().repeat_interleave(32, -1)[:, :D]
    ok = s >= torch.finfo(torch.float16).tiny
    ok[:2] = False
    assert ok.sum() > 10 * D and ((back - x).abs()[ok] <= s[ok] * (0.5 + 1e-3)).all()


@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [64, 80, 128])      # 80: groups of 32, 32, 16 (the scalar loop)
def test_store_op_writes_the_reference_bytes(src, D):
    g = torch.Generator().manual_seed(5)
    N, bs, H = 40, 16, 3
    W = kq.row_width(I8, D)
    for T in (5, 300):       # 300: the threaded path
        mag = torch.logspace(-4, 4, T)[:, None, None]
        k = (torch.randn(T, H, D, generator=g) * mag).to(src)
        v = (torch.randn(T, H, D, generator=g) * mag.flip(0)).to(src)
        k[0, 0, :3] = torch.tensor([float("inf"), -float("inf"), -0.0])     # the scale saturates, codes +-127
        kc, vc = torch.zeros(N, bs, H, W, dtype=I8), torch.zeros(N, bs, H, W, dtype=I8)
        slots = torch.randperm(N * bs, generator=g)[:T]
        slots[1] = -1                                       # padding: nothing written
        ca().store_kv(k, v, kc, vc, slots)
        keep = slots >= 0
        assert torch.equal(kc.view(-1, H, W)[slots[keep]], kq.quantize_int8(k[keep]))
        assert torch.equal(vc.view(-1, H, W)[slots[keep]], kq.quantize_int8(v[keep]))
        assert int(kc.ne(0).any(-1).any(-1).view(-1).sum()) == int(keep.sum())


def bf16_path(qdtype, D) -> bool:
    """Whether paged_attention takes its VDPBF16PS paths, which read an int8 cache's rows rounded to bf16."""
    return qdtype == torch.bfloat16 and D in (64, 128) and ca().attention_isa() == "avx512_bf16"


def i8_batch(seed, qlens, ctxs, heads, qdtype):
    q, kc, vc, qsl, bt, tables = make_batch(seed, qlens, ctxs, *heads, torch.float32)
    spread = torch.logspace(-2, 0, kc.shape[-1])            # groups of different magnitudes within a row
    return q.to(qdtype), kq.quantize_int8(kc * spread * 40), kq.quantize_int8(vc * spread.flip(0)), qsl, bt, tables


@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"hq{h[0]}-hkv{h[1]}-d{h[2]}")
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_op_matches_oracle_on_dequantised_cache(qdtype, heads, scenario):
    qlens, ctxs = SCENARIOS[scenario]
    window = 300 if scenario == "mixed" else None
    q, kc, vc, qsl, bt, tables = i8_batch(heads[0] * 7 + heads[2], qlens, ctxs, heads, qdtype)
    scale = heads[2] ** -0.5 / 40
    step = (torch.tensor(qsl, dtype=torch.int32), torch.tensor(ctxs, dtype=torch.int32), bt, scale, window)
    out = ca().paged_attention(q, kc, vc, *step)
    assert out.dtype == qdtype
    kf, vf = kq.dequantize(kc), kq.dequantize(vc)
    if bf16_path(qdtype, heads[2]):     # the rows rounded to bfloat16, then the bf16 cache's own kernel
        kf, vf = kf.bfloat16(), vf.bfloat16()
        assert torch.equal(out, ca().paged_attention(q, kf, vf, *step))
    ref, mag = oracle(q, kf, vf, qsl, ctxs, tables, scale, window, magnitude=True)
    if qdtype == torch.bfloat16:
        assert_close_p_rounded(out, ref, mag)
    else:
        close(out, ref, qdtype)


@pytest.mark.parametrize("isa", ["avx2", "baseline"])
def test_lower_instruction_sets_agree_on_int8(isa):
    op = ca()
    qlens, ctxs = [1, 1, 3, 8, 70], [5, 1000, 30, 2000, 300]
    for heads in [(9, 3, 64), (8, 1, 128), (6, 3, 80)]:
        q, kc, vc, qsl, bt, _ = i8_batch(11, qlens, ctxs, heads, torch.float32)
        args = (q, kc, vc, torch.tensor(qsl, dtype=torch.int32), torch.tensor(ctxs, dtype=torch.int32), bt, 0.004)
        best, low = op.paged_attention(*args), op.paged_attention(*args, isa=isa)
        torch.testing.assert_close(low, best, atol=2e-6 * best.abs().max().item(), rtol=1e-5)


def test_op_refuses_scales_and_a_dense_width():
    op = ca()
    q, kc, vc, qsl, bt, _ = i8_batch(2, [1], [20], (4, 2, 64), torch.float32)
    args = (torch.tensor(qsl, dtype=torch.int32), torch.tensor([20], dtype=torch.int32), bt, 0.1)
    with pytest.raises(RuntimeError, match="float8 caches only"):
        op.paged_attention(q, kc, vc, *args, k_scale=2.0)
    with pytest.raises(RuntimeError, match="int8 cache's rows"):
        op.paged_attention(q, kc[..., :64].contiguous(), vc[..., :64].contiguous(), *args)
    with pytest.raises(RuntimeError, match="heads/head_dim differ"):
        op.store_kv(torch.randn(1, 2, 64), torch.randn(1, 2, 64), kc[..., :64].contiguous(),
                    vc[..., :64].contiguous(), torch.tensor([0]))


@pytest.mark.parametrize("impl", ["op", "torch"])
def test_torch_backend_stores_and_attends_like_the_reference(impl):
    """The engine's CPU backend, both paths: store_kv writes the reference rows, forward (decodes, a
    verification query and prefill chunks) equals paged_attention_ref on them."""
    from batchrun.kernels.cpu_attention import paged_attention_ref
    from batchrun.models.attention import AttentionMetadata, TorchAttentionBackend
    if impl == "op":
        ca()
    qlens, ctxs = [1, 1, 5, 40], [30, 700, 60, 40]
    q, kc, vc, qsl, bt, _ = i8_batch(5, qlens, ctxs, (9, 3, 64), torch.float32)
    bt = bt.clamp(0, kc.shape[0] - 1)       # the engine pads block tables with real ids; the torch path reads them
    meta = AttentionMetadata(slot_mapping=torch.tensor([3, 17, 40]), query_start_loc=torch.tensor(qsl, dtype=torch.int32),
                             seq_lens=torch.tensor(ctxs, dtype=torch.int32), block_tables=bt, num_decodes=2,
                             max_query_len=40, max_seq_len=700, query_start_loc_host=qsl, seq_lens_host=ctxs)
    be = TorchAttentionBackend(impl)
    k, v = torch.randn(3, 3, 64) * 30, torch.randn(3, 3, 64)
    be.store_kv(k, v, kc, vc, meta)
    W = kq.row_width(I8, 64)
    assert torch.equal(kc.view(-1, 3, W)[meta.slot_mapping], kq.quantize_int8(k))
    assert torch.equal(vc.view(-1, 3, W)[meta.slot_mapping], kq.quantize_int8(v))
    out = be.forward(q, kc, vc, meta, 0.004, None)
    close(out, paged_attention_ref(q, kc, vc, meta.query_start_loc, meta.seq_lens, bt, 0.004, None))
    assert be.impl == impl


def test_int8_bytes_in_the_ledger_and_the_blocks(hf_models):
    """A row is head_dim codes and 2 bytes per 32 of them: the ledger, validate's estimate and the block
    count follow (qwen3 head_dim 32: 34 bytes against bf16's 64)."""
    path = hf_models["qwen3"][0]
    info = inspect_model(path)
    mem = kv_budget(path, 34, torch.bfloat16)
    bf16 = LLM(path, dtype="bfloat16", kv_cache_memory=mem, max_model_len=256, max_num_seqs=64).engine.memory_ledger
    i8 = LLM(path, dtype="bfloat16", kv_cache_dtype="int8", kv_cache_memory=mem, max_model_len=256,
             max_num_seqs=64).engine.memory_ledger
    assert i8["kv_cache_dtype"] == "int8"
    assert i8["kv_bytes_per_token"] == 2 * info.num_layers * info.num_kv_heads * 34 == info.kv_bytes_per_token(I8)
    assert bf16["num_blocks"] == 34 and i8["num_blocks"] == 64


def test_job_file_takes_int8_and_fingerprints_it(tmp_path, tiny_model):  # noqa: F811
    from test_kv_fp8_engine import _plan
    auto, i8, fp8 = (_plan(tmp_path, tiny_model, **kw).fingerprint for kw in
                     ({}, {"kv_cache_dtype": "int8"}, {"kv_cache_dtype": "fp8"}))
    assert i8["model"]["kv_cache_dtype"] == "int8" and i8 != auto and i8 != fp8


def test_int8_needs_no_calibration_pass():
    from batchrun.engine.config import EngineConfig
    from batchrun.models.calibration import needs_calibration
    assert not needs_calibration(EngineConfig(model="x", kv_cache_dtype="int8", quantization_calibration=8))
    assert needs_calibration(EngineConfig(model="x", kv_cache_dtype="fp8", quantization_calibration=8))
