"""W8A8's block rotation (models/w8a8.py rotate_blocks): a Hadamard matrix per block of 64 columns along K,
applied to the weight when it is quantized and to x in the quantizing pass, against a float64 oracle built
from the matrix's definition (H[i, j] = (-1)^popcount(i & j) / 8), not from the butterflies."""
from __future__ import annotations

import pytest
import torch

from batchrun.models.w8a8 import ROTATION, W8A8Weight, quantize_rows, quantize_w8, rotate_blocks, rotates


def hadamard64() -> torch.Tensor:
    i = torch.arange(ROTATION)
    bits = torch.tensor([bin(int(v)).count("1") for v in (i[:, None] & i[None, :]).flatten()]).view(ROTATION, -1)
    return (1 - 2 * (bits % 2)).double() / ROTATION ** 0.5


def rotation(k: int) -> torch.Tensor:
    return torch.block_diag(*[hadamard64()] * (k // ROTATION))


@pytest.mark.parametrize("k", [64, 576, 1536])
def test_rotate_blocks_is_the_block_hadamard_product(k):
    torch.manual_seed(k)
    x = torch.randn(7, k) * 3
    got = rotate_blocks(x.clone())
    ref = x.double() @ rotation(k)
    torch.testing.assert_close(got.double(), ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(rotate_blocks(got.clone()), x, rtol=0, atol=1e-5)     # its own inverse


def test_rotates_only_where_the_block_divides_k():
    assert rotates(576) and rotates(64) and not rotates(96) and not rotates(576, False)
    with pytest.raises(ValueError, match="multiple of 64"):
        W8A8Weight(*quantize_w8(torch.randn(16, 96)), rotate=True)


def test_rotation_shrinks_the_error_of_an_outlier_channel():
    """One large channel per block: unrotated, its group's step swamps the others; rotated, it is spread."""
    torch.manual_seed(0)
    x = torch.randn(32, 576) * 0.1
    x[:, ::64] = 50.0
    errs = {}
    for rotate in (False, True):
        qx, sx = quantize_rows(x, None, 64, rotate)
        back = (qx.float().view(32, 9, 64) * sx[..., None]).view(32, 576)
        back = rotate_blocks(back) if rotate else back
        errs[rotate] = (back - x).pow(2).mean().sqrt().item()
    assert errs[True] < errs[False] / 4, errs


@pytest.mark.parametrize("group", [64, 32, 0])
def test_rotated_weight_is_the_weight_it_quantized(group):
    """W8A8Weight(rotate=True) holds the codes of W @ R: dequantize() gives W back within half a step per
    code (in the rotated basis), and linear(x) is x @ dequantize().T within what rounding x's rotated codes
    can move it: sum_k sx/2 * |q * s| per output."""
    torch.manual_seed(group)
    n, k = 48, 576
    w = torch.randn(n, k) * torch.rand(n, 1)
    q, s = quantize_w8(rotate_blocks(w.clone()), group or None)
    qw = W8A8Weight(q, s, None, False, rotate=True)
    g = group or k
    step = s.view(n, -1).repeat_interleave(g, 1)
    err_rot = (qw.dequantize().double() @ rotation(k) - w.double() @ rotation(k)).abs()
    assert (err_rot <= step / 2 * (1 + 1e-5) + 1e-6).all()
    x = torch.randn(5, k) * 2
    y, ref = qw.linear(x).double(), x.double() @ qw.dequantize().double().T
    _, sx = quantize_rows(x, None, group or None, True)
    wr = (q.double() * step.double()).abs()                                   # |q * s|, the rotated codes' weight
    bound = (sx.double().repeat_interleave(g, 1) / 2) @ wr.T * (1 + 1e-4) + 1e-4
    assert ((y - ref).abs() <= bound).all()


def test_engine_rotates_every_projection_it_can(hf_models, monkeypatch, tmp_path):
    """apply_w8a8 rotates each projection whose K 64 divides (the tiny models: all), and ROTATE off none;
    the ledger says which."""
    from batchrun import LLM
    from batchrun.models import smoothquant
    from batchrun.models.w8a8 import W8A8Weight as W
    monkeypatch.setenv("BATCHRUN_CALIBRATION_CACHE", str(tmp_path))
    for rotate in (True, False):
        monkeypatch.setattr(smoothquant, "ROTATE", rotate)
        llm = LLM(hf_models["llama"][0], dtype="bfloat16", quantization="w8a8", quantization_calibration=2,
                  max_model_len=128, max_num_seqs=4)
        ws = [m.weight for m in llm.engine.runner.model.modules() if isinstance(getattr(m, "weight", None), W)]
        assert ws and all(w.rotate == rotates(w.shape[1], rotate) for w in ws)
        assert llm.engine.memory_ledger["calibration"]["rotate"] is rotate
