"""The weight-only Triton matmuls (batchrun.kernels.quant_matmul) against their torch references, the int4
nibble layout CUDA weights use, and quant.py's choice of layout and kernel by device.

On CPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set here before the kernels are
imported) at small shapes; on CUDA the same cases run on the GPU, and an engine with int8/int4 weights is
held token for token to the dequantised-weights model (BATCHRUN_QUANT_KERNELS=0).

Tolerances, relative to the output's scale (its largest magnitude): in float32 the kernel and the reference
multiply the same float32 values (the int4 weight dequantised by the same formula) and sum in another order,
so they agree to float32 rounding over K terms: 1e-5. In bfloat16 (8 significant bits) the kernels round
their output to bfloat16 and the int4 kernel feeds tl.dot the weight rounded to bfloat16 (as the engine's
dequantised reference does), where the reference stays in float32 until its output. On a GPU each rounding
is to nearest (at most 2^-8 relative); Triton's interpreter truncates (up to 2^-7, and biased: the weights'
errors add up instead of cancelling), measured at up to 0.010 of the output's scale for K = 256. 2^-5
bounds both with a margin and still fails a wrong nibble, group or scale by far (the float32 cases catch
the subtle ones).
"""
from __future__ import annotations

import importlib
import os
from types import SimpleNamespace

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"   # must precede the @triton.jit decorations in batchrun.kernels

import pytest  # noqa: E402

import batchrun.kernels.quant_matmul as qmm  # noqa: E402
from batchrun.kernels._common import is_interpreted  # noqa: E402
from batchrun.models.quant import (QUANT_KERNELS_ENV, Int4Weight, check_quantization, quantize_int4,  # noqa: E402
                                   quantize_int8, quantized_nbytes)

if not CUDA and qmm.HAS_TRITON and not is_interpreted(qmm._int8_kernel):
    importlib.reload(qmm)    # imported before TRITON_INTERPRET was set: decorate again (quant.py holds the module)

DEV = torch.device("cuda" if CUDA else "cpu")
needs_triton = pytest.mark.skipif(not qmm.HAS_TRITON, reason="triton is not installed")
TOL = {torch.float32: 1e-5, torch.bfloat16: 2 ** -5}
ROWS = [1, 5, 33]          # one row, a remainder inside one M tile, and past a 32-row tile
NS = [72, 200]             # not multiples of any N tile (32, 64); 200 pads to 256 rows in the int4 layout
DTYPES = [torch.float32, torch.bfloat16]


def check_close(out, ref, dtype):
    assert out.dtype == dtype and out.shape == ref.shape
    scale = ref.float().abs().max().item()
    torch.testing.assert_close(out.float(), ref.float(), rtol=TOL[dtype], atol=TOL[dtype] * scale)


def int4_weight(n, k, group, dtype, layout="nibbles", seed=0):
    """An Int4Weight of random codes, scales and zeros in the given layout (on CPU)."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen)
    scales = torch.rand(n, k // group, generator=gen) * 0.1 + 0.01
    zeros = torch.randn(n, k // group, generator=gen) * 0.05
    return Int4Weight(codes, scales, zeros, group, dtype, layout=layout), codes


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("m", ROWS)
def test_int8_kernel_matches_reference(m, n, dtype):
    gen = torch.Generator().manual_seed(m * 1000 + n)
    k = 160                # a remainder past every K tile (64, 128)
    qw = quantize_int8(torch.randn(n, k, generator=gen), dtype)
    x = torch.randn(m, k, generator=gen).to(dtype).to(DEV)
    q, s = qw.q.to(DEV), qw.scales.to(DEV)
    check_close(qmm.int8_matmul(x, q, s), qmm.int8_matmul_reference(x, q, s), dtype)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("m", ROWS)
def test_int4_kernel_matches_reference(m, n, group, dtype):
    qw, _ = int4_weight(n, 256, group, dtype, seed=m + n + group)
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m)).to(dtype).to(DEV)
    args = (qw.packed.to(DEV), qw.scales_and_zeros.to(DEV), group, n)
    out = qmm.int4_matmul(x, *args)
    ref = qmm.int4_matmul_reference(x, *args)
    check_close(out, ref, dtype)
    # and the reference is the dequantised weight's product
    check_close(ref, (x.float() @ qw.dequantize().to(DEV).T), dtype)


@needs_triton
def test_strided_rows_and_empty_inputs():
    """x may be a row slice (last dim contiguous); no rows gives an empty output without a launch."""
    qw, _ = int4_weight(72, 128, 64, torch.float32)
    big = torch.randn(4, 256, device=DEV)
    x = big[:, :128]
    args = (qw.packed.to(DEV), qw.scales_and_zeros.to(DEV), 64, 72)
    check_close(qmm.int4_matmul(x, *args), qmm.int4_matmul_reference(x.contiguous(), *args), torch.float32)
    assert qmm.int4_matmul(big[:0, :128], *args).shape == (0, 72)
    q8 = quantize_int8(torch.randn(72, 128), torch.float32)
    check_close(qmm.int8_matmul(x, q8.q.to(DEV), q8.scales.to(DEV)),
                qmm.int8_matmul_reference(x.contiguous(), q8.q.to(DEV), q8.scales.to(DEV)), torch.float32)


def test_nibble_layout_round_trips_codes():
    codes = torch.randint(0, 16, (70, 96))
    packed = qmm.pack_int4(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (70, 48)
    assert torch.equal(qmm.unpack_int4(packed), codes.to(torch.int32))
    # byte [r, j] holds code 2j in its low nibble and code 2j + 1 in its high one
    assert qmm.pack_int4(torch.tensor([[3, 12, 15, 0]])).tolist() == [[3 | 12 << 4, 15]]


@pytest.mark.parametrize("n,group", [(64, 32), (72, 64), (200, 128)])
def test_both_int4_layouts_hold_the_same_weight_in_the_same_bytes(n, group):
    """The CUDA (nibble) layout, built here on CPU tensors, against torch's CPU layout from the same codes."""
    k = 256
    cpu, codes = int4_weight(n, k, group, torch.float32, layout="cpu", seed=n)
    nib, _ = int4_weight(n, k, group, torch.float32, layout="nibbles", seed=n)
    assert (cpu.layout, nib.layout) == ("cpu", "nibbles")
    assert torch.equal(nib.codes(), codes.to(torch.int32)) and torch.equal(cpu.codes(), nib.codes())
    assert torch.equal(nib.dequantize(), cpu.dequantize())
    assert torch.equal(nib.scales_and_zeros, cpu.scales_and_zeros)
    assert nib.nbytes == cpu.nbytes == quantized_nbytes("int4", n, k, group, torch.float32)
    assert nib.packed[n:].eq(0x88).all()          # padded rows: code 8 (and scale 0, zero 0)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_int4_weight_in_the_nibble_layout_runs_the_triton_kernel(dtype):
    """Int4Weight.linear with the nibble layout calls int4_matmul (under the interpreter on CPU) and agrees
    with the CPU layout's torch kernel and with the dequantised reference."""
    w = torch.randn(72, 128)
    cpu = quantize_int4(w, 32, dtype)
    sz = cpu.scales_and_zeros[:, :72]
    nib = Int4Weight(cpu.codes().to(DEV), sz[..., 0].T.to(DEV), sz[..., 1].T.to(DEV), 32, dtype, layout="nibbles")
    assert nib._has_kernel(DEV)
    x = torch.randn(3, 2, 128).to(dtype)            # leading dims, as the model's [tokens, ...] inputs
    ref = x.float() @ cpu.dequantize().T
    check_close(nib.linear(x.to(DEV)).cpu(), ref, dtype)
    check_close(cpu.linear(x), ref, dtype)


def test_layout_follows_the_device_and_kernels_by_device():
    qw, _ = int4_weight(64, 64, 32, torch.float32, layout=None)
    assert qw.layout == "cpu" and qw._has_kernel(torch.device("cpu")) and not qw._has_kernel(torch.device("cuda"))
    q8 = quantize_int8(torch.randn(8, 64), torch.float32)
    assert q8._has_kernel(torch.device("cpu")) and q8._has_kernel(torch.device("cuda")) == qmm.HAS_TRITON
    if CUDA:       # quantize_int4 of a CUDA weight (what the engine does there) gets the nibble layout
        assert quantize_int4(torch.randn(8, 64, device="cuda"), 32, torch.float32).layout == "nibbles"


def test_check_quantization_allows_cuda_only_with_triton(monkeypatch):
    info = SimpleNamespace(format="safetensors", config={}, path="m")
    cuda = torch.device("cuda")               # a device object: no GPU needed to build it
    if qmm.HAS_TRITON:
        check_quantization("int8", 128, info, cuda)
    monkeypatch.setattr(qmm, "HAS_TRITON", False)
    with pytest.raises(ValueError, match=r"quantization: 'int8' runs on CPU, or on CUDA with Triton installed"):
        check_quantization("int8", 128, info, cuda)
    with pytest.raises(ValueError, match="runs on CPU"):
        check_quantization("int4", 32, info, torch.device("mps"))
    check_quantization("int8", 128, info, torch.device("cpu"))


def _int4_args(k=128, group=32, n=72, dtype=torch.float32):
    qw, _ = int4_weight(n, k, group, dtype)
    return torch.randn(3, k, dtype=dtype), qw.packed, qw.scales_and_zeros, group, n


def _int8_args():
    qw = quantize_int8(torch.randn(40, 96), torch.float32)
    return torch.randn(3, 96), qw.q, qw.scales


def _bad_int8(i):
    x, q, s = _int8_args()
    return [((x[0], q, s), "x must be 2-D"),
            ((x, q.to(torch.int32), s), "q must have dtype int8"),
            ((x, q[:, :64].contiguous(), s), r"q must have shape \[\*, 96\]"),
            ((x, q, s[:39]), r"scales must have shape \[40\]"),
            ((x.to(torch.int32), q, s), "x must have dtype"),
            ((x.t().contiguous().t(), q, s), "x must have a contiguous last dimension")][i]


def _bad_int4(i):
    x, p, sz, g, n = _int4_args()
    return [((x[:, :127].contiguous(), p, sz, g, n), r"x's K \(127\) must be even"),
            ((x[:, :96].contiguous(), p, sz, g, n), r"packed must have shape \[\*, 48\]"),
            ((x, p.to(torch.int32), sz, g, n), "packed must have dtype uint8"),
            ((x, p, sz, 48, n), r"group must be a positive multiple of 32 dividing K \(128\), got 48"),
            ((x, p, sz, 256, n), "group must be a positive multiple of 32 dividing K"),
            ((x, p, sz, 64, n), r"scales_and_zeros must have shape \[2, 128, 2\]"),
            ((x, p, sz[:, :64].contiguous(), g, n), r"scales_and_zeros must have shape \[4, 128, 2\]"),
            ((x, p, sz, g, 129), r"n \(output features\) must lie in \[1, 128\]"),
            ((x, p, sz.to(torch.int32), g, n), "scales_and_zeros must have dtype")][i]


@pytest.mark.parametrize("i", range(6))
def test_int8_bad_arguments_raise(i):
    args, match = _bad_int8(i)
    for fn in (qmm.int8_matmul, qmm.int8_matmul_reference):
        with pytest.raises(ValueError, match=match):
            fn(*args)


@pytest.mark.parametrize("i", range(9))
def test_int4_bad_arguments_raise(i):
    args, match = _bad_int4(i)
    for fn in (qmm.int4_matmul, qmm.int4_matmul_reference):
        with pytest.raises(ValueError, match=match):
            fn(*args)


def test_pack_int4_refuses_odd_k():
    with pytest.raises(ValueError, match="K even"):
        qmm.pack_int4(torch.zeros(4, 7, dtype=torch.int32))


@pytest.mark.skipif(not CUDA, reason="the engine's Triton quantized products need CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode,group", [("int8", 128), ("int4", 32), ("int4", 64)])
def test_cuda_engine_matches_the_dequantised_weights_model(hf_models, monkeypatch, mode, group, dtype):
    """Greedy tokens of an engine whose linear layers run the Triton kernels equal those of the same engine
    with BATCHRUN_QUANT_KERNELS=0 (dequantise-then-F.linear); the weights are in the nibble layout."""
    from conftest import assert_same_greedy_with_env_off
    path = hf_models["llama"][0]
    kw = {"quantization": mode, "quantization_group_size": group, "device": "cuda"}
    assert_same_greedy_with_env_off(path, monkeypatch, QUANT_KERNELS_ENV, "quant_kernels", dtype, **kw)
    from batchrun import LLM
    monkeypatch.delenv(QUANT_KERNELS_ENV)
    model = LLM(path, dtype=dtype, max_num_seqs=4, **kw).engine
    assert model.memory_ledger["quantization"] == mode
