"""W8A8 (batchrun.models.w8a8, models/smoothquant.py): the int8 product against a float64 reference of the
same quantised math, SmoothQuant's folding against the unsmoothed float model, and engines whose top-1 agrees
with the float32 model.

Bounds: the int32 sum of int8 products is exact in every kernel (and in float32 while |sum| < 2^24, so the
"float" fallback too); then two float32 multiplications (the weight's scale, the row's), each rounding by at
most 2^-24 relative; oneDNN may fold the scales first: a third rounding. So |y - ref| <= 4 * 2^-24 * |ref|.
With G groups along K each group's term rounds so, and the G - 1 additions each by 2^-24 of the partial sum:
|y - ref| <= (G + 3) * 2^-24 * sum_g |term_g|."""
import pytest
import torch

from batchrun.models.calibration import _CausalBackend, collect_stats
from batchrun.models.smoothquant import check_w8a8, smooth_model
from batchrun.models.w8a8 import (BUCKETS, GROUP, W8A8Weight, _candidates, choose_kernels, group_for, quantize_rows,
                                  quantize_w8)

KERNELS = _candidates()
GROUPED_KERNELS = _candidates(grouped=True)


def terms64(qx, sx, w: W8A8Weight) -> torch.Tensor:
    """[G, M, N] float64: each group's sx * scale * (its codes' integer product)."""
    g, sw = w.group, w.scales.double().reshape(w.shape[0], -1)
    return torch.stack([(qx[:, k:k + g].double() @ w.qt[k:k + g].double()) * sw[:, i] * sx[:, i:i + 1].double()
                        for i, k in enumerate(range(0, w.shape[1], g))])


def ref64(qx, sx, w: W8A8Weight):
    return terms64(qx, sx, w).sum(0)


@pytest.mark.parametrize("rows", [1, 3, 17, 64, 300])
@pytest.mark.parametrize("shape,group", [((96, 160), None), ((96, 160), 32), ((40, 24), None), ((576, 1536), None),
                                         ((576, 1536), 32)])
def test_int8_product_equals_float64_reference(group, rows, shape):
    """Every candidate kernel, per row (one group) and with groups of 32 columns along K."""
    torch.manual_seed(rows)
    w = W8A8Weight(*quantize_w8(torch.randn(*shape) * torch.rand(shape[0], 1), group))
    assert w.grouped == bool(group)
    qx, sx = quantize_rows(torch.randn(rows, shape[1]) * 5, None, group)
    terms = terms64(qx, sx, w)
    ref, bound = terms.sum(0), (terms.shape[0] + 3) * 2 ** -24 * terms.abs().sum(0)
    for kernel in GROUPED_KERNELS if group else KERNELS:
        y = w.product(qx, sx, kernel)
        assert y.dtype == torch.float32 and y.shape == (rows, shape[0])
        assert ((y.double() - ref).abs() <= bound).all(), kernel


def test_quantizers_are_within_half_a_step():
    x = torch.randn(33, 70) * torch.rand(33, 1) * 9
    x[3] = 0                                        # an all-zero row: codes 0
    before = x.clone()
    qx, sx = quantize_rows(x)
    assert torch.equal(x, before)                   # the input is left as it was
    assert ((qx.float() * sx - x).abs() <= sx / 2 * (1 + 1e-6)).all() and qx.abs().max() == 127
    assert sx[3] > 0 and (qx[3] == 0).all()
    q, s = quantize_w8(x)
    assert ((q.float() * s[:, None] - x).abs() <= s[:, None] / 2 * (1 + 1e-6)).all()
    xg = x[:, :64]                                  # groups of 16: a scale per row and group, each its own max
    qx, sx = quantize_rows(xg, None, 16)
    assert sx.shape == (33, 4) and torch.equal(qx.view(33, 4, 16).abs().amax(-1) == 127, xg.view(33, 4, 16).abs()
                                                .amax(-1) > 0)
    err = (qx.float().view(33, 4, 16) * sx[..., None] - xg.view(33, 4, 16)).abs()
    assert (err <= sx[..., None] / 2 * 1.000001).all()
    q, s = quantize_w8(xg, 16)
    assert s.shape == (33, 4)
    assert ((q.float().view(33, 4, 16) * s[..., None] - xg.view(33, 4, 16)).abs() <= s[..., None] / 2 * 1.000001).all()
    torch.testing.assert_close(W8A8Weight(q, s).dequantize(), (q.float().view(33, 4, 16) * s[..., None]).view(33, 64))
    assert [group_for(k) for k in (576, 1536, 64, 24, 100)] == [64, 64, 64, 24, 100]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_with_runtime_smoothing_is_the_quantised_math(dtype):
    torch.manual_seed(1)
    x, s = torch.randn(9, 48).to(dtype), torch.rand(48) + 0.5
    w = W8A8Weight(*quantize_w8(torch.randn(32, 48) * s), inv_smooth=1 / s)
    b = torch.randn(32).to(dtype)
    qx, sx = quantize_rows(x, 1 / s)
    expect = (ref64(qx, sx, w) + b.double()).to(dtype)
    out = w.linear(x, b)
    assert out.dtype == dtype
    # the product rounds to dtype, then the bias adds: one more rounding of dtype
    torch.testing.assert_close(out.float(), expect.float(), rtol=2 ** -7, atol=2 ** -7 * expect.abs().max().item())


@pytest.mark.parametrize("group", [None, 32])
def test_kernel_choice_is_per_bucket_and_runs_the_chosen_kernel(group):
    ws = [W8A8Weight(*quantize_w8(torch.randn(64, 96), group)) for _ in range(3)]
    codes, scales = ws[0].qt.clone(), ws[0].scales.clone()
    choice = choose_kernels(ws, budget_s=0.05)
    # where the own kernel runs every bucket its packed codes and scales are the one copy kept, and give them back
    only_own = set(choice.values()) == {"own"}
    assert (ws[0]._qt is None) == only_own and (ws[0]._scales is None) == only_own
    assert torch.equal(ws[0].qt, codes) and torch.equal(ws[0].scales, scales)
    choose_kernels(ws, budget_s=0.05)                 # a second choice starts from the same codes
    assert torch.equal(ws[0].qt, codes) and torch.equal(ws[0].scales, scales)
    assert list(choice) == list(BUCKETS) and set(choice.values()) <= set(GROUPED_KERNELS if group else KERNELS)
    assert all(ws[0].kernel_for(b) == choice[b] for b in BUCKETS)
    assert ws[0].kernel_for(5000) == choice[BUCKETS[-1]]
    assert all((w._onednn is not None) == ("onednn" in choice.values()) for w in ws)   # counted in nbytes


def test_kernels_off_runs_the_float_reference(hf_models, monkeypatch):
    monkeypatch.setenv("BATCHRUN_QUANT_KERNELS", "0")
    monkeypatch.setenv("BATCHRUN_CALIBRATION_CACHE", "0")
    llm = _model(hf_models["llama"][0], dtype="bfloat16", quantization="w8a8", quantization_calibration=2)
    assert llm.engine.memory_ledger["calibration"]["w8a8_kernels"].startswith("float")
    w = llm.engine.runner.model.layers[0].mlp.down_proj.weight
    assert all(w.kernel_for(b) == "float" for b in BUCKETS)


def _model(path, dtype="float32", **kw):
    from batchrun import LLM
    return LLM(path, dtype=dtype, max_num_seqs=4, **kw)


def _hidden(model, ids):
    backend = _CausalBackend(len(model.layers))
    backend.lengths = [len(ids)]
    with torch.inference_mode():
        h = model(torch.tensor(ids), torch.arange(len(ids)), torch.zeros(len(model.layers), 2, 1), None, backend)
        return model.compute_logits(h)


class _Scaled:
    """x * inv @ w.T: the run-time division of an unfolded projection, in float."""
    def __init__(self, w, inv):
        self.w, self.inv = w, inv

    def linear(self, x, b=None):
        return torch.nn.functional.linear(x * self.inv, self.w, b)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_smoothing_leaves_the_float_model_unchanged(hf_models, arch, monkeypatch, tmp_path):
    monkeypatch.setenv("BATCHRUN_CALIBRATION_CACHE", "0")
    model = _model(hf_models[arch][0]).engine.runner.model
    ids = list(range(5, 80))
    before, ln = _hidden(model, ids), model.layers[0].input_layernorm.weight.clone()
    stats = collect_stats(model, [ids, list(range(100, 140))])
    smoothed = smooth_model(model, stats["act_absmax"], alpha=0.5, unfolded="runtime")
    for name, (w, inv) in smoothed.items():
        mod = model.get_submodule(name)
        del mod._parameters["weight"]
        mod.weight = w if inv is None else _Scaled(w, inv)
    after = _hidden(model, ids)
    # the norms' weights really changed (the factors are not 1), the output did not beyond float32 rounding
    assert (model.layers[0].input_layernorm.weight - ln).abs().max() > 0.01
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4 * before.abs().max().item())


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
def test_w8a8_top1_agrees_with_float32(hf_models, arch, monkeypatch, tmp_path):
    """Teacher-forced top-1 over 300 positions: W8A8 (bf16 activations) vs the float32 model. Invariant:
    >= 85% agree. These random models' top-1 margins are narrow (bf16 alone keeps ~96% of float32's top-1,
    W8A8 88-95%); a wrong scale, transpose or smoothing factor drops it to chance (~0.2%). The real model's
    figures (>= 97% vs bf16 targeted) are scripts/bench_quant.py's."""
    monkeypatch.setenv("BATCHRUN_CALIBRATION_CACHE", str(tmp_path))
    path = hf_models[arch][0]
    ref = _model(path).engine.runner.model
    llm = _model(path, dtype="bfloat16", quantization="w8a8", quantization_calibration=8)
    led = llm.engine.memory_ledger
    assert led["quantization"] == "w8a8" and led["calibration"]["rows"] == 8
    assert set(led["calibration"]["w8a8_kernels"].values()) <= set(KERNELS)
    q = llm.engine.runner.model
    assert isinstance(q.layers[0].self_attn.qkv_proj.weight, W8A8Weight)
    g = torch.Generator().manual_seed(3)
    agree = total = 0
    for n in (60, 100, 140):
        ids = torch.randint(3, 500, (n,), generator=g).tolist()
        a, b = _hidden(ref, ids).argmax(-1), _hidden(q, ids).argmax(-1)
        agree, total = agree + (a == b).sum().item(), total + n
    assert agree / total >= 0.85, agree / total
    from batchrun import SamplingParams         # and the engine's own path (paged prefill + decode) runs it
    out = llm.generate([{"prompt_token_ids": list(range(5, 40))}], SamplingParams(max_tokens=8, temperature=0),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8


def test_w8a8_bad_settings_are_one_line_errors(hf_models, tmp_path, monkeypatch):
    from batchrun.engine.config import EngineConfig
    from batchrun.models.loader import ModelError
    monkeypatch.setenv("BATCHRUN_CALIBRATION_CACHE", "0")
    path = hf_models["llama"][0]
    with pytest.raises(ModelError, match=r"^quantize_lm_head: 'w8a8'") as e:
        _model(path, quantization="w8a8", quantize_lm_head=True, quantization_calibration=2)
    assert "\n" not in str(e.value)
    for bad in (0, -3, True, ""):
        with pytest.raises(ValueError, match="^quantization_calibration must be"):
            EngineConfig(model=path, quantization_calibration=bad)
    model = _model(path).engine.runner.model
    mod = model.layers[1].mlp.down_proj
    del mod._parameters["weight"]
    mod.weight = torch.zeros(64, 128, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^quantization: 'w8a8' .* layer layers.1.mlp.down_proj has torch.int32"):
        check_w8a8(model)


@pytest.mark.parametrize("group", [None, 0, 32])
def test_validate_predicts_the_w8a8_engines_weight_bytes(hf_models, monkeypatch, group):
    """models/quant.weight_bytes_after (what `validate` prints) against the loaded engine's tensors: the
    parameters left (embedding, norms) plus each W8A8Weight's codes, scales and 1/s (a oneDNN-packed copy, and
    the own kernel's offsets and padded scales, kept only where this machine's timing chose it, cannot be
    predicted and are left out of both; where the own kernel runs every bucket its packed codes and scales are
    the one copies kept, and they count as the codes and scales)."""
    from batchrun.engine.config import quantization_group
    from batchrun.models.loader import inspect_model
    from batchrun.models.quant import weight_bytes_after
    monkeypatch.setenv("BATCHRUN_CALIBRATION_CACHE", "0")
    for arch in ("llama", "qwen2"):
        path = hf_models[arch][0]
        model = _model(path, quantization="w8a8", quantization_calibration=2,
                       quantization_group_size=group).engine.runner.model
        real = sum(p.numel() * p.element_size() for p in model.parameters())
        for m in model.modules():
            w = getattr(m, "weight", None)
            if isinstance(w, W8A8Weight):
                own = w._own
                copies = [w._onednn] + ([own.offset] if own is not None else [])
                if w._qt is not None and own is not None:     # both copies of the codes kept: count one
                    copies.append(own.wp)
                if w._scales is not None and own is not None:
                    copies.append(own.scales)
                real += sum(t.numel() * t.element_size() for t in w.tensors() if all(t is not c for c in copies))
        predicted = weight_bytes_after(inspect_model(path), "w8a8", quantization_group("w8a8", group), False,
                                       torch.float32)[0]
        assert predicted == real


@pytest.mark.skipif("own" not in KERNELS, reason="the own W8A8 kernel needs AVX-512 VNNI")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("smooth", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 64, 301])
@pytest.mark.parametrize("shape,rotate", [((40, 24), False), ((576, 1536), False), ((576, 1536), True),
                                          ((96, 22), False), ((96, 192), True)])
def test_own_kernel_equals_the_int_mm_path_bit_for_bit(dtype, smooth, rows, shape, rotate):
    """Quantizing x (rotated per block of 64 or not) and scaling the int32 sums in the kernel: the same codes
    and float32 roundings as quantize_rows + torch._int_mm (so the same bf16 outputs); an all-zero row
    included."""
    torch.manual_seed(rows)
    n, k = shape
    s = torch.rand(k) + 0.5 if smooth else None
    w = W8A8Weight(*quantize_w8(torch.randn(n, k)), inv_smooth=None if s is None else 1 / s, rotate=rotate)
    x = (torch.randn(rows, k) * torch.rand(rows, 1) * 7).to(dtype)
    x[rows // 2] = 0
    own, ref = w.run(x, "own"), w.run(x, "int_mm")
    assert own.dtype == dtype and torch.equal(own, ref)
    assert (w._own is not None) == (k % 4 == 0)            # K=22 does not fit the layout: torch's kernel ran


@pytest.mark.skipif("own" not in GROUPED_KERNELS, reason="the own W8A8 kernel needs AVX-512 VNNI")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("smooth", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 7, 64, 301])
@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("shape,group", [((40, 64), 16), ((576, 1536), 64), ((96, 192), 64), ((32, 128), 128)])
def test_own_kernel_with_groups_is_the_grouped_math(dtype, smooth, rows, shape, group, rotate):
    """With groups, the op's codes and scales are quantize_rows' bit for bit (an all-zero row included; rotated
    per block of 64 or not), and its product is the float64 reference of those codes within the bound (then
    rounded once to bf16)."""
    torch.manual_seed(rows)
    n, k = shape
    inv = 1 / (torch.rand(k) + 0.5) if smooth else None
    w = W8A8Weight(*quantize_w8(torch.randn(n, k) * torch.rand(n, 1), group), inv_smooth=inv, rotate=rotate)
    x = (torch.randn(rows, k) * torch.rand(rows, 1) * 7).to(dtype)
    x[rows // 2] = 0
    u8, sx = torch.ops.batchrun_cpu.w8a8_quantize(x, torch.empty(0) if inv is None else inv, group, rotate)
    qx, sx_ref = quantize_rows(x, inv, group, rotate)
    assert torch.equal(u8.to(torch.int16) - 128, qx.to(torch.int16)) and torch.equal(sx, sx_ref)
    terms = terms64(qx, sx_ref, w)
    ref, bound = terms.sum(0), (terms.shape[0] + 3) * 2 ** -24 * terms.abs().sum(0)
    own = w.run(x, "own")
    assert own.dtype == dtype and w._own is not None
    rounding = 2 ** -8 * ref.abs() if dtype == torch.bfloat16 else 0
    assert ((own.double() - ref).abs() <= bound + rounding).all()


@pytest.mark.parametrize("group", [64, 32])
@pytest.mark.parametrize("kernel", ["own", "int_mm"])
def test_whole_layer_op_runs_w8a8_as_the_per_op_path(hf_models, monkeypatch, kernel, group):
    """The one-call decoder layer takes the own kernel's packed int8 projections (the SmoothQuant division of
    o/down included) and gives the per-op path's greedy tokens; where another kernel was measured fastest the
    step runs the per-op path. Groups of 64 (the default) leave the tiny model's 64-wide inputs one group, so
    a layer mixes both forms; 32 groups every projection."""
    from batchrun import SamplingParams
    from batchrun.kernels import cpu_decoder_layer, cpu_w8a8
    if not cpu_w8a8.supported():
        pytest.skip("no AVX-512 VNNI here: the op takes no int8 projection (models/cpu_fused._op_form)")
    import batchrun.models.w8a8 as w8a8
    monkeypatch.setattr(w8a8, "_candidates", lambda grouped=False: [kernel])        # forces the measured choice
    monkeypatch.setattr(w8a8, "GROUP", group)
    monkeypatch.setenv("BATCHRUN_CALIBRATION_CACHE", "0")
    calls = []
    real = cpu_decoder_layer.decoder_layer
    monkeypatch.setattr(cpu_decoder_layer, "decoder_layer", lambda *a, **k: (calls.append(len(a[-1])), real(*a, **k)))
    prompts = [{"prompt_token_ids": p} for p in ([5, 6, 7, 8], list(range(10, 60)), [3] * 20)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    kw = dict(dtype="bfloat16", quantization="w8a8", quantization_calibration=2)
    whole = _model(hf_models["llama"][0], **kw)
    assert whole.engine.memory_ledger["decoder_layer_op"] is True
    a = whole.generate(prompts, params, use_tqdm=False)
    assert calls == ([12] * len(calls) if kernel == "own" else []) and (calls or kernel != "own")
    monkeypatch.setenv("BATCHRUN_CPU_LAYER_OP", "0")
    per_op = _model(hf_models["llama"][0], **kw)
    assert per_op.engine.memory_ledger["decoder_layer_op"] is False
    b = per_op.generate(prompts, params, use_tqdm=False)
    assert [x.token_ids for x in a] == [y.token_ids for y in b]


_EXACT_ON_EXTREMES = """
import torch
from batchrun.models.w8a8 import W8A8Weight, _candidates, _extreme_codes
q, x = _extreme_codes()
w = W8A8Weight(q, torch.ones(q.shape[0]))
ref = x.double() @ q.double().T
for k in _candidates():
    assert torch.equal(w.product(x, torch.ones(4, 1), k).double(), ref), k
wg = W8A8Weight(q, torch.ones(q.shape[0], 4))            # four groups of 16, unit scales: the same sums
for k in _candidates(grouped=True):
    assert torch.equal(wg.product(x, torch.ones(4, 4), k).double(), ref), k
print(" ".join(_candidates()), "|", " ".join(_candidates(grouped=True)))
"""


@pytest.mark.parametrize("caps", [{}, {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                                      "BATCHRUN_TEST_MAX_ISA": "avx2"}])
def test_every_candidate_kernel_is_exact_at_the_ends_of_the_range(caps):
    """Sums of +-127 x +-127 codes, every sign pattern, equal the float64 product in each kernel the choice may
    pick, here and on the AVX2 kind's ISA (where torch._int_mm saturates int16 pair sums and is left out)."""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA",
                                                            "BATCHRUN_TEST_MAX_ISA")}
    r = subprocess.run([sys.executable, "-c", _EXACT_ON_EXTREMES], env={**env, **caps}, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split()[-1] == "float"


def test_quantization_group_size_sets_the_w8a8_groups(hf_models, monkeypatch):
    """The knob reaches every projection (a layer whose input the group does not divide takes one group, as does
    0); its default is w8a8.GROUP; 0 and 16 are refused for int4, 16 for w8a8, each naming the knob."""
    from batchrun.engine.config import W8A8_DEFAULT_GROUP, EngineConfig
    monkeypatch.setenv("BATCHRUN_CALIBRATION_CACHE", "0")
    assert W8A8_DEFAULT_GROUP == GROUP
    assert EngineConfig(model="m", quantization="w8a8").group_size == GROUP
    assert EngineConfig(model="m", quantization="int4").group_size == 128
    assert EngineConfig(model="m", quantization="w8a8", quantization_group_size=0).group_size == 0
    for kind, bad in (("int4", 0), ("int4", 16), ("w8a8", 16), ("w8a8", True)):
        with pytest.raises(ValueError, match=f"quantization_group_size must be .*got {bad!r}"):
            EngineConfig(model="m", quantization=kind, quantization_group_size=bad)
    path = hf_models["llama"][0]
    for group in (0, 32):
        model = _model(path, quantization="w8a8", quantization_calibration=2,
                       quantization_group_size=group).engine.runner.model
        ws = [m.weight for m in model.modules() if isinstance(getattr(m, "weight", None), W8A8Weight)]
        assert ws and all(w.group == (group if group and w.shape[1] % group == 0 else w.shape[1]) for w in ws)
        assert any(w.grouped for w in ws) == bool(group)
