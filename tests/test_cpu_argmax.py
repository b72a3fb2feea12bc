"""The compiled greedy argmax (batchrun.kernels.cpu_argmax) against its reference, torch.max(dim=-1).indices,
on every code path this machine runs: ties (the first maximal index wins), NaN (the first NaN, as torch),
rows all -inf, widths on both sides of the vector blocks (scalar tails), strided rows, float32 and bfloat16,
and enough rows to run on the threads. The engine's greedy steps use it with the fused layer ops: their
engine tests (test_cpu_layer_ops.py) compare those tokens with the torch path's."""
import shutil

import pytest
import torch

from batchrun.kernels import cpu_argmax, cpu_attention

if shutil.which("c++") is None and shutil.which("g++") is None:
    pytest.skip("no C++ compiler to build the CPU ops", allow_module_level=True)

WIDTHS = [1, 3, 8, 31, 32, 33, 64, 100, 1000, 32000]


@pytest.fixture(scope="module", autouse=True)
def built():
    assert cpu_attention.load(), cpu_attention.status()["error"]


@pytest.fixture(params=["baseline", "avx2"])
def isa(request):
    if request.param == "avx2" and cpu_attention.cpu_isa() == "baseline":
        pytest.skip("this machine has no AVX2")
    return request.param


def cases(n: int, dtype: torch.dtype, g: torch.Generator) -> list[torch.Tensor]:
    neg = float("-inf")
    out = [torch.randn(5, n, generator=g).to(dtype),
           torch.randint(0, 3, (6, n), generator=g).to(dtype),          # many ties
           torch.zeros(2, n, dtype=dtype), torch.full((2, n), neg, dtype=dtype)]
    x = torch.randn(3, n, generator=g).to(dtype)
    x[0, n // 2] = float("nan")
    x[1, n - 1] = float("nan")
    x[1, 0] = float("nan") if n > 1 else x[1, 0]
    out.append(x)
    y = torch.full((3, n), neg, dtype=dtype)
    y[0, n - 1] = 1.0                                                     # the max in the scalar tail
    y[1, n // 3] = float("nan")
    out.append(y)
    if n > 1:
        out.append(torch.randn(4, 2 * n, generator=g).to(dtype)[:, :n])  # strided rows
    return out


@pytest.mark.parametrize("dtype", cpu_argmax.DTYPES)
@pytest.mark.parametrize("n", WIDTHS)
def test_equals_torch_max_indices(isa, dtype, n):
    g = torch.Generator().manual_seed(n)
    for x in cases(n, dtype, g):
        got = cpu_argmax.argmax(x, isa)
        assert got.dtype == torch.int64
        assert torch.equal(got, x.max(dim=-1).indices), (x, got)


@pytest.mark.parametrize("dtype", cpu_argmax.DTYPES)
def test_many_rows_on_the_threads(isa, dtype):
    x = torch.randn(64, 32000, generator=torch.Generator().manual_seed(1)).to(dtype)
    x[7, 100] = x[7, 31999] = x[7].max() + 1                              # a tie, far apart
    assert torch.equal(cpu_argmax.argmax(x, isa), x.max(dim=-1).indices)


def test_other_inputs_take_the_reference():
    for x in (torch.randn(3, 10, dtype=torch.float16), torch.randn(10, 3).t(), torch.randn(2, 3, 4)):
        assert torch.equal(cpu_argmax.argmax(x), x.max(dim=-1).indices)
