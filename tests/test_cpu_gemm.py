"""batchrun's bf16 projection kernel (batchrun.kernels.cpu_gemm) against float64 products and torch's F.linear,
the reference: within the float-accumulation bound of a K-term sum plus one bfloat16 rounding, on the row
counts of decode steps and prefill chunks (every tile remainder), output widths with a partial last block,
strided rows; then the engine with its weights in this layout."""
import pytest
import torch

from batchrun import LLM, SamplingParams
from batchrun.kernels import cpu_gemm
from batchrun.models.cpu_linear import forms_for, linear, onednn_bf16, pack
from batchrun.models.kernel_choice import GEMM_ENV

pytestmark = pytest.mark.skipif(not cpu_gemm.supported(), reason="this CPU has neither AVX-512 BF16 nor AVX2")
MACHINE_ISA = cpu_gemm.isa() if cpu_gemm.supported() else "none"


@pytest.fixture(params=["avx512_bf16", "avx2"])
def isa(request):
    """Each kernel path this machine can run (the AVX2 one runs on AVX-512 machines too, capped)."""
    if request.param == "avx512_bf16" and MACHINE_ISA != "avx512_bf16":
        pytest.skip("this CPU has no AVX-512 BF16")
    old = cpu_gemm.set_isa(request.param)
    assert cpu_gemm.isa() == request.param
    yield request.param
    cpu_gemm.set_isa(old)


def within_bound(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """|got - x @ w.T| <= one bf16 rounding of the result + K float32 roundings of the running sum."""
    exact = x.double() @ w.double().T
    K = x.shape[1]
    bound = 2.0 ** -8 * exact.abs() + K * 2.0 ** -24 * (x.double().abs() @ w.double().abs().T) + 1e-30
    err = (got.double() - exact).abs()
    assert bool((err <= bound).all()), float((err / bound).max())


@pytest.mark.parametrize("M", [1, 2, 3, 5, 6, 7, 12, 13, 23, 24, 27, 64, 301])
@pytest.mark.parametrize("N,K", [(16, 2), (48, 64), (100, 64), (40, 258), (64, 2), (960, 576), (576, 1536)])
def test_linear_is_the_product_within_rounding(isa, M, N, K):
    g = torch.Generator().manual_seed(M * 1000 + N)
    w = (torch.randn(N, K, generator=g) * 0.05).to(torch.bfloat16)
    x = (torch.randn(M, K + 6, generator=g)).to(torch.bfloat16)[:, 3:3 + K]      # strided rows
    wp = cpu_gemm.pack(w)
    grouped = isa == "avx512_bf16" and N % 64 == 0                  # the layout pack picks for this ISA
    shape = (N // 64, K // 2, 4, 16, 2) if grouped else (-(-N // 16), K // 2, 16, 2)
    assert wp.shape == shape and cpu_gemm.packed_rows(wp) == -(-N // 16) * 16
    assert torch.equal(cpu_gemm.unpack(wp, N), w)
    got = cpu_gemm.linear(x, wp, N)
    if grouped:                                                      # the blocks layout: the same sums
        assert torch.equal(cpu_gemm.linear(x, cpu_gemm.pack(w, grouped=False), N), got)
    assert got.shape == (M, N) and got.dtype == torch.bfloat16
    within_bound(got, x, w)
    ref = torch.nn.functional.linear(x, w)
    within_bound(ref, x, w)                                          # the bound is one torch meets too
    assert (got.float() - ref.float()).abs().max() <= 2.0 ** -6 * ref.float().abs().max()


@pytest.mark.parametrize("M", [24, 64, 301])
def test_the_split_over_threads_changes_no_bit(isa, M):
    """576 outputs make 9 groups of 64, too few to balance two threads: rows are split too. Every output is
    still one tile's sum in the same order, whatever the split."""
    g = torch.Generator().manual_seed(M)
    w = (torch.randn(576, 1536, generator=g) * 0.05).to(torch.bfloat16)
    x = torch.randn(M, 1536, generator=g).to(torch.bfloat16)
    wp = cpu_gemm.pack(w)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_gemm.linear(x, wp, 576)
        torch.set_num_threads(4)
        assert torch.equal(cpu_gemm.linear(x, wp, 576), one)
    finally:
        torch.set_num_threads(threads)
    within_bound(one, x, w)


@pytest.fixture
def nontemporal():
    """Non-temporal weight loads for the test, the process's mode restored after."""
    old = cpu_gemm.set_weight_loads("nontemporal")
    yield
    cpu_gemm.set_weight_loads(old)


def _misaligned(wp: torch.Tensor) -> torch.Tensor:
    """wp's values in a contiguous tensor 32 bytes past a 64-byte boundary (non-temporal loads refuse it)."""
    buf = torch.empty(wp.numel() + 64, dtype=wp.dtype)
    start = (-buf.data_ptr() % 64) // 2 + 16
    out = buf[start:start + wp.numel()].view(wp.shape)
    assert out.data_ptr() % 64 == 32 and out.is_contiguous()
    return out.copy_(wp)


@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 6, 7, 13])
@pytest.mark.parametrize("N,K", [(64, 2), (100, 64), (960, 576), (576, 1536)])
def test_nontemporal_loads_change_no_bit(isa, nontemporal, M, N, K):
    """Non-temporal weight loads (one row tile: up to 6 rows on AVX-512 BF16, 4 on AVX2) read the same
    values: the products equal ordinary loads' bit for bit, in both layouts and from a weight that is not
    64-byte aligned (which takes ordinary loads)."""
    g = torch.Generator().manual_seed(M * 7 + N)
    w = (torch.randn(N, K, generator=g) * 0.05).to(torch.bfloat16)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    layouts = [cpu_gemm.pack(w)] + ([cpu_gemm.pack(w, grouped=False)] if isa == "avx512_bf16" and N % 64 == 0
                                    else [])
    for wp in layouts:
        assert cpu_gemm.weight_loads() == "nontemporal"
        got = cpu_gemm.linear(x, wp, N)
        odd = cpu_gemm.linear(x, _misaligned(wp), N)
        cpu_gemm.set_weight_loads("cached")
        want = cpu_gemm.linear(x, wp, N)
        cpu_gemm.set_weight_loads("nontemporal")
        assert torch.equal(got, want) and torch.equal(odd, want)
        within_bound(got, x, w)


def test_weight_load_modes_are_named():
    old = cpu_gemm.set_weight_loads("nontemporal")
    try:
        assert cpu_gemm.weight_loads() == "nontemporal"
        assert cpu_gemm.set_weight_loads("cached") == "nontemporal" and cpu_gemm.weight_loads() == "cached"
        with pytest.raises(ValueError, match="weight loads must be one of cached, nontemporal"):
            cpu_gemm.set_weight_loads("streaming")
    finally:
        cpu_gemm.set_weight_loads(old)


def test_bias_and_the_model_side_dispatch():
    w = (torch.randn(64, 32) * 0.1).to(torch.bfloat16)
    b = torch.randn(64).to(torch.bfloat16)
    x = torch.randn(5, 32).to(torch.bfloat16)
    wp = pack(w, "own")
    assert wp.dim() in (4, 5)                                        # batchrun's layouts, not oneDNN's
    within_bound(linear(x, wp), x, w)
    ref = torch.nn.functional.linear(x, w, b)
    assert (linear(x, wp, b).float() - ref.float()).abs().max() <= 2.0 ** -6 * ref.float().abs().max()


def test_bad_arguments_are_refused():
    wp = cpu_gemm.pack(torch.zeros(32, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="K=6"):
        cpu_gemm.linear(torch.zeros(2, 6, dtype=torch.bfloat16), wp, 32)
    with pytest.raises(RuntimeError, match="bfloat16"):
        cpu_gemm.linear(torch.zeros(2, 8), wp, 32)
    with pytest.raises(RuntimeError, match="n=40"):
        cpu_gemm.linear(torch.zeros(2, 8, dtype=torch.bfloat16), wp, 40)
    with pytest.raises(ValueError, match="even"):
        cpu_gemm.pack(torch.zeros(16, 7, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="multiple of 64"):
        cpu_gemm.pack(torch.zeros(48, 8, dtype=torch.bfloat16), grouped=True)


@pytest.mark.skipif(MACHINE_ISA != "avx512_bf16", reason="the groups layout is the AVX-512 BF16 kernel's")
def test_the_avx2_kernel_refuses_the_groups_layout():
    wp = cpu_gemm.pack(torch.zeros(64, 8, dtype=torch.bfloat16), grouped=True)
    old = cpu_gemm.set_isa("avx2")
    try:
        with pytest.raises(RuntimeError, match="groups layout"):
            cpu_gemm.linear(torch.zeros(1, 8, dtype=torch.bfloat16), wp, 64)
    finally:
        cpu_gemm.set_isa(old)


def test_bf16_engine_runs_on_the_own_layout_and_agrees_with_onednn(hf_models, monkeypatch):
    """The same bf16 model in both layouts: the first token of every prompt (one prefill each) is the same;
    later tokens may part after a near-tie (the float sums run in another order)."""
    path = hf_models["llama"][0]
    prompts = [{"prompt_token_ids": p} for p in ([5, 6, 7, 8], list(range(10, 60)), [3] * 20)]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    own = LLM(path, dtype="bfloat16", max_num_seqs=4)
    assert own.engine.runner.model.layers[0].mlp.down_proj.weight.dim() in (4, 5)
    monkeypatch.setenv(GEMM_ENV, "onednn")
    onednn = LLM(path, dtype="bfloat16", max_num_seqs=4)
    w = onednn.engine.runner.model.layers[0].mlp.down_proj.weight
    # oneDNN's packed layout where its bf16 kernels run here, else the first form that can hold it (ONEDNN_MAX_CPU_ISA
    # below AVX-512 turns oneDNN's bf16 off: the AVX2 kind)
    down = onednn.engine.runner.model.layers[0].mlp.down_proj
    fallback = forms_for((down.out_features, down.in_features))
    if onednn_bf16():
        assert w.is_mkldnn
    else:
        assert not w.is_mkldnn and (w.dim() in (4, 5) if fallback[0] == "own" else w.dim() == 2)
    a, b = (llm.generate(prompts, params, use_tqdm=False) for llm in (own, onednn))
    assert [x.token_ids for x in a] == [y.token_ids for y in b]
