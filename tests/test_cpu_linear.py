"""Projection weights packed for oneDNN (batchrun.models.cpu_linear) against torch's plain F.linear, the
reference: the same products, and a bf16 engine whose greedy tokens match the unpacked engine."""
import pytest
import torch

from batchrun.models.cpu_linear import GEMM_ENV, PACKED_LINEAR_ENV, linear, pack, packing_supported
from conftest import assert_same_greedy_with_env_off

pytestmark = pytest.mark.skipif(not packing_supported(torch.bfloat16),
                                reason="neither batchrun's bf16 kernel nor oneDNN's runs here: the plain path is used")


@pytest.mark.parametrize("rows", [1, 3, 16, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("layout", ["own", "onednn"])
def test_packed_linear_equals_f_linear(rows, bias, layout, monkeypatch):
    monkeypatch.setenv(GEMM_ENV, layout)      # "own": batchrun's kernel where the CPU has it, else oneDNN's
    torch.manual_seed(rows)
    w = torch.randn(384, 96).bfloat16()
    b = torch.randn(384).bfloat16() if bias else None
    x = torch.randn(rows, 96).bfloat16()
    ref = torch.nn.functional.linear(x, w, b)
    out = linear(x, pack(w, 64), b)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_fp32_is_never_packed():
    assert not packing_supported(torch.float32)


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="this CPU's oneDNN has no bf16 kernels")
@pytest.mark.parametrize("arch", ["llama", "qwen2"])      # qwen2: q/k/v bias and tied embeddings
def test_bf16_engine_with_onednn_packed_weights_matches_the_plain_one(hf_models, monkeypatch, arch):
    monkeypatch.setenv(GEMM_ENV, "onednn")     # oneDNN's layout: the same sums as F.linear (cpu_gemm's: test_cpu_gemm)
    assert_same_greedy_with_env_off(hf_models[arch][0], monkeypatch, PACKED_LINEAR_ENV, "packed_linear")
