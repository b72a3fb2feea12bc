"""Each form a bf16 projection weight can take (batchrun.models.cpu_linear: own kernel, oneDNN's packed
layout, plain) against torch's plain F.linear, the reference: the same products, and a bf16 engine on
oneDNN's layout whose greedy tokens match the plain one."""
import pytest
import torch

from batchrun.models.cpu_linear import ChosenWeight, forms_for, linear, pack, packing_supported
from batchrun.models.kernel_choice import GEMM_ENV, bucket_of
from conftest import assert_same_greedy_with_env_off

pytestmark = pytest.mark.skipif(not packing_supported(torch.bfloat16),
                                reason="neither batchrun's bf16 kernel nor oneDNN's runs here: the plain path is used")


@pytest.mark.parametrize("rows", [1, 3, 16, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("form", forms_for((384, 96)))
def test_each_form_equals_f_linear(rows, bias, form):
    torch.manual_seed(rows)
    w = torch.randn(384, 96).bfloat16()
    b = torch.randn(384).bfloat16() if bias else None
    x = torch.randn(rows, 96).bfloat16()
    ref = torch.nn.functional.linear(x, w, b)
    out = linear(x, pack(w, form, 64), b)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_a_chosen_weight_runs_each_bucket_on_its_form():
    torch.manual_seed(0)
    w = torch.randn(64, 32).bfloat16()
    forms = forms_for(w.shape)
    per_bucket = tuple(forms[i % len(forms)] for i in range(6))
    cw = ChosenWeight({f: pack(w, f) for f in forms}, per_bucket, bucket_of)
    for rows in (1, 2, 3, 8, 9, 32, 33, 128, 129, 512, 513, 700):
        form = per_bucket[bucket_of(rows)]
        assert cw.form_for(rows) is cw.forms[form]
        x = torch.randn(rows, 32).bfloat16()
        assert torch.equal(cw.linear(x), linear(x, cw.forms[form]))


def test_an_odd_width_cannot_take_the_own_layout():
    assert "own" not in forms_for((100, 96)) and "own" not in forms_for((96, 33))
    assert forms_for((100, 96))[-1] == "plain"


def test_fp32_is_never_packed():
    assert not packing_supported(torch.float32)


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="this CPU's oneDNN has no bf16 kernels")
@pytest.mark.parametrize("arch", ["llama", "qwen2"])      # qwen2: q/k/v bias and tied embeddings
def test_bf16_engine_with_onednn_packed_weights_matches_the_plain_one(hf_models, monkeypatch, arch):
    monkeypatch.setenv(GEMM_ENV, "onednn")     # oneDNN's layout: the same sums as F.linear (cpu_gemm's: test_cpu_gemm)
    assert_same_greedy_with_env_off(hf_models[arch][0], monkeypatch, GEMM_ENV, "packed_linear", off="plain")
