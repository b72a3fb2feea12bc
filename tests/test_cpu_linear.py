"""Projection weights packed for oneDNN (batchrun.models.cpu_linear) against torch's plain F.linear, the
reference: the same products, and a bf16 engine whose greedy tokens match the unpacked engine."""
import pytest
import torch

from batchrun import LLM, SamplingParams
from batchrun.models.cpu_linear import PACKED_LINEAR_ENV, linear, pack, packing_supported

pytestmark = pytest.mark.skipif(not packing_supported(torch.bfloat16),
                                reason="this CPU's oneDNN has no bf16 kernels: the plain path is used")


@pytest.mark.parametrize("rows", [1, 3, 16, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear(rows, bias):
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


@pytest.mark.parametrize("arch", ["llama", "qwen2"])      # qwen2: q/k/v bias and tied embeddings
def test_bf16_engine_with_packed_weights_matches_the_plain_one(hf_models, monkeypatch, arch):
    path = hf_models[arch][0]
    prompts = [[5, 6, 7, 8], list(range(10, 60)), [3] * 20]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    packed = LLM(path, dtype="bfloat16", max_num_seqs=4)
    assert packed.engine.memory_ledger["packed_linear"] is True
    monkeypatch.setenv(PACKED_LINEAR_ENV, "0")
    plain = LLM(path, dtype="bfloat16", max_num_seqs=4)
    assert plain.engine.memory_ledger["packed_linear"] is False
    a = packed.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    b = plain.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
