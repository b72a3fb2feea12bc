"""The compiled elementwise layer ops (batchrun.kernels.cpu_layer_ops) against the model's own torch math
(batchrun/models/llama.py), on every ISA this machine runs: bfloat16 bit-identical (each op rounds where
the math rounds), float32 within 1e-6 relative, a few ulp (the norm's summation order, our exp); odd widths reach the
scalar tails, strided rows the views the model passes. Then the engine: bf16 greedy tokens with the fused
ops equal those of the torch math, on Llama and Qwen3 (per-head q/k norms)."""
import shutil

import pytest
import torch

from batchrun.kernels import cpu_attention, cpu_layer_ops as ops
from batchrun.models.cpu_fused import FUSED_OPS_ENV
from batchrun.models.llama import apply_rope, rms_norm, rope_tables
from batchrun.models.rope import cos_sin_cache, rope_params
from conftest import assert_same_greedy_with_env_off

if shutil.which("c++") is None and shutil.which("g++") is None:
    pytest.skip("no C++ compiler to build the CPU ops", allow_module_level=True)

MACHINE_ISA = None
ROPE = rope_params({"rope_theta": 10000.0})


@pytest.fixture(scope="module", autouse=True)
def built():
    global MACHINE_ISA
    assert ops.available(), cpu_attention.status()["error"]
    MACHINE_ISA = cpu_attention.cpu_isa()


@pytest.fixture(params=["baseline", "avx2", "avx512"])
def isa(request):
    order = ["baseline", "avx2", "avx512"]
    if order.index(request.param) > order.index(MACHINE_ISA):
        pytest.skip(f"this machine runs {MACHINE_ISA}")
    old = ops.set_isa(request.param)
    yield request.param
    ops.set_isa(old)


def same(got, want, dtype):
    """bfloat16: bit-identical; float32: within 1e-6 relative (the norm's float sum runs in another order than
    torch's, and our exp is not torch's: a few ulp, far below what a bf16 rounding or a greedy tie needs)."""
    if dtype == torch.bfloat16:
        assert torch.equal(got, want), (got.float() - want.float()).abs().max()
    else:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-30)


def rows(T, H, dtype, seed, strided=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H + 7 if strided else H, generator=g) * 2
    return (x[:, 3:3 + H] if strided else x).to(dtype)


DTYPES = [torch.float32, torch.bfloat16]
SHAPES = [(1, 576), (5, 37), (64, 512), (3, 9)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H", SHAPES)
def test_rms_norm(isa, dtype, T, H):
    x, w = rows(T, H, dtype, 0, strided=True), (1 + 0.2 * torch.randn(H)).to(dtype)
    same(ops.rms_norm(x, w, 1e-5), rms_norm(x, w, 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H", SHAPES)
def test_add_rms_norm_updates_the_residual(isa, dtype, T, H):
    x, w = rows(T, H, dtype, 1), (1 + 0.2 * torch.randn(H)).to(dtype)
    res = rows(T, H, dtype, 2)
    want_res = res + x                                   # one rounding, as the model's `h + o`
    got = ops.add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(res, want_res)
    same(got, rms_norm(want_res, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D,Hq,Hkv,T", [(64, 9, 3, 5), (128, 4, 1, 2), (32, 2, 2, 17), (10, 3, 1, 3)])
def test_rope_in_place_on_views_of_the_qkv_projection(isa, dtype, D, Hq, Hkv, T):
    table = cos_sin_cache(D, ROPE, 300)
    qkv = rows(T, (Hq + 2 * Hkv) * D, dtype, 3)
    pos = torch.randint(0, 300, (T,), generator=torch.Generator().manual_seed(T))
    q, k, _ = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
    q, k = q.view(T, Hq, D), k.view(T, Hkv, D)
    cos, sin = rope_tables(table, pos, dtype)
    want_q, want_k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    v_before = qkv[:, (Hq + Hkv) * D:].clone()
    ops.rope_(q, k, table, pos)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)   # products rounded as torch rounds them
    assert torch.equal(qkv[:, (Hq + Hkv) * D:], v_before)       # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,I", [(1, 1536), (4, 13), (33, 256)])
def test_silu_mul(isa, dtype, T, I):
    gate_up = rows(T, 2 * I, dtype, 4) * 3                        # past exp's clamp at both ends too
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0], dtype=dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    same(ops.silu_mul(gate_up), torch.nn.functional.silu(gate) * up, dtype)


def test_bad_arguments_are_refused():
    table = cos_sin_cache(8, ROPE, 4)
    q, k = torch.zeros(2, 1, 8), torch.zeros(2, 1, 8)
    with pytest.raises(RuntimeError, match="outside the RoPE table"):
        ops.rope_(q, k, table, torch.tensor([0, 4]))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.rms_norm(torch.zeros(2, 8, dtype=torch.float16), torch.ones(8, dtype=torch.float16), 1e-6)
    with pytest.raises(RuntimeError, match="weight"):
        ops.rms_norm(torch.zeros(2, 8), torch.ones(7), 1e-6)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])      # qwen3: per-head q/k norms
def test_bf16_engine_with_fused_ops_matches_the_torch_math(hf_models, monkeypatch, arch):
    assert_same_greedy_with_env_off(hf_models[arch][0], monkeypatch, FUSED_OPS_ENV, "fused_layer_ops")
