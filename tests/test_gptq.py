"""GPTQ rounding of W8A8's weights (models/gptq.py) against float64 oracles and round-to-nearest."""
from __future__ import annotations

import pytest
import torch

from batchrun.models import gptq
from batchrun.models.w8a8 import quantize_w8, rotate_blocks


def dequant(q: torch.Tensor, s: torch.Tensor, group: int) -> torch.Tensor:
    n, k = q.shape
    return (q.double().view(n, -1, group) * s.double().view(n, -1, 1)).view(n, k)


@pytest.mark.parametrize("k", [64, 128, 576, 200])
def test_block_gram_is_the_diagonal_blocks_of_xtx(k):
    torch.manual_seed(k)
    x = torch.randn(300, k)
    g = gptq.block_gram(x)
    full = x.double().T @ x.double()
    assert g.shape == (gptq.blocks_of(k), gptq.BLOCK, gptq.BLOCK)
    for b in range(g.shape[0]):
        lo, hi = b * gptq.BLOCK, min(k, (b + 1) * gptq.BLOCK)
        torch.testing.assert_close(g[b, : hi - lo, : hi - lo].double(), full[lo:hi, lo:hi], rtol=1e-5, atol=1e-3)
        assert not g[b, hi - lo:].any() and not g[b, :, hi - lo:].any()            # K's padding: zeros


@pytest.mark.parametrize("rotate", [False, True])
def test_change_basis_is_the_gram_of_the_smoothed_rotated_input(rotate):
    torch.manual_seed(1)
    k = 576
    x, f = torch.randn(200, k), torch.rand(k) + 0.2
    xs = x / f
    want = gptq.block_gram(rotate_blocks(xs.clone()) if rotate else xs)
    got = gptq.change_basis(gptq.block_gram(x), k, f, rotate)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-2)


@pytest.mark.parametrize("group", [64, 32, 576])
def test_uncorrelated_inputs_give_round_to_nearest(group):
    """With a diagonal Hessian no error has anywhere to go: the codes and scales are quantize_w8's."""
    torch.manual_seed(group)
    w = torch.randn(40, 576) * torch.rand(40, 1)
    gram = torch.diag_embed(torch.rand(gptq.blocks_of(576), gptq.BLOCK) + 0.5)
    q, s = gptq.quantize(w, gram, group)
    q0, s0 = quantize_w8(w, None if group == 576 else group)
    assert torch.equal(q, q0) and s.shape == s0.shape and torch.allclose(s, s0, rtol=1e-6, atol=0)


@pytest.mark.parametrize("group", [64, 32, 576])
def test_gptq_lowers_the_output_error_on_correlated_inputs(group):
    """Inputs correlated within blocks (as a layer's are): the output error on them, |X (W - Wq)^T|^2, is below
    round-to-nearest's; every code is an int8 in [-127, 127] on scales of quantize_w8's shape."""
    torch.manual_seed(3)
    k, n = 576, 96
    mix = torch.block_diag(*[torch.randn(64, 64) / 8 + torch.eye(64) for _ in range(k // 64)])
    x = torch.randn(2000, k) @ mix * (torch.rand(k) * 3 + 0.1)
    w = torch.randn(n, k)
    q, s = gptq.quantize(w, gptq.block_gram(x), group)
    q0, s0 = quantize_w8(w, None if group == k else group)
    assert q.dtype == torch.int8 and q.abs().max() <= 127 and s.shape == s0.shape
    err = (x.double() @ (dequant(q, s, group) - w.double()).T).pow(2).mean()
    err0 = (x.double() @ (dequant(q0, s0, group) - w.double()).T).pow(2).mean()
    assert err < 0.8 * err0, (err, err0)


def test_dead_columns_and_padding_stay_finite():
    """An input column that never fired (a zero row/column of the Hessian: its weight multiplies zeros, so GPTQ
    zeroes it) and K not a multiple of BLOCK."""
    torch.manual_seed(4)
    x = torch.randn(100, 192)
    x[:, 5] = 0
    w = torch.randn(16, 192)
    q, s = gptq.quantize(w, gptq.block_gram(x), 64)
    assert torch.isfinite(s).all() and q.shape == (16, 192) and not q[:, 5].any()
    live = torch.arange(192) != 5
    assert (dequant(q, s, 64) - w.double())[:, live].abs().max() < 0.2 * w.abs().max()


def test_engine_rounds_by_gptq_and_caches_the_hessian_blocks(hf_models, monkeypatch, tmp_path):
    """w8a8 collects the Hessian blocks in its calibration pass and rounds by GPTQ (the ledger says so); a
    cached file from before (statistics without them) is recomputed once and rewritten with them."""
    from batchrun import LLM
    from batchrun.models import smoothquant
    monkeypatch.setenv("BATCHRUN_CALIBRATION_CACHE", str(tmp_path))
    kw = dict(dtype="bfloat16", quantization="w8a8", quantization_calibration=2, max_model_len=128, max_num_seqs=4)
    monkeypatch.setattr(smoothquant, "GPTQ", False)
    first = LLM(hf_models["llama"][0], **kw).engine.memory_ledger["calibration"]
    assert first["rounding"] == "nearest" and not first["cached"]
    assert "gram" not in torch.load(first["cache_path"], weights_only=True)
    monkeypatch.setattr(smoothquant, "GPTQ", True)
    second = LLM(hf_models["llama"][0], **kw).engine.memory_ledger["calibration"]
    assert second["rounding"] == "gptq" and not second["cached"] and second["cache_path"] == first["cache_path"]
    stats = torch.load(second["cache_path"], weights_only=True)
    assert set(stats["gram"]) == set(stats["act_absmax"])
    third = LLM(hf_models["llama"][0], **kw).engine.memory_ledger["calibration"]
    assert third["rounding"] == "gptq" and third["cached"]
