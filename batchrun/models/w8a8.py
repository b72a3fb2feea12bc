"""W8A8 linear layers (quantization="w8a8"): int8 weights and int8 activations, an int32 product.

Symmetric int8 codes in groups of GROUP columns along K (llama.cpp's Q8_0 x Q8_0 form): weights w = q * scale
per output channel and group, activations (dynamic) x = qx * sx per token and group, sx = max|x| / 127 over
the group. So y[m, n] = sum_g sx[m, g] * scale[n, g] * sum_{k in g} qx[m, k] q[n, k]: each group's sum is
exact in int32 and its two scales come out of it. A projection whose K GROUP does not divide takes one group
(per-row activations, per-channel weights: the form torch's and oneDNN's int8 GEMMs take). Groups are the
default because on SmolLM2 they keep what per-row scales lose (scripts/bench_quant.py: top-1 vs bf16 and
perplexity). SmoothQuant (models/smoothquant.py) balances the channels before the weights are quantized; a
projection whose input has no norm to fold the factors into divides x by them here (`smooth`), or takes none.
Where ROTATION divides K the weight's codes are of W @ R (R: a Hadamard matrix per block of 64 columns) and x
is rotated alike before its quantization (rotate_blocks, and the own kernel's pass); the codes are rounded by
GPTQ where the calibration pass collected its Hessian blocks (models/gptq.py).

The int32 product has more than one implementation; which one runs for a row count is measured at
quantize time on the model's own shapes (choose_kernels: one kernel per row-count bucket, kernel_choice()
says which for the log and the ledger):
- "own": batchrun's AVX-512 VNNI kernel (kernels/cpu_w8a8.py): the activations quantized and the product's
  scales applied in one pass each; with one group bit for bit the int_mm path's result, with groups each
  group's sum folded in by a multiply and an FMA.
- "int_mm" (one group only): torch._int_mm(qx, q.T) with q.T stored K-major (contiguous [K, N]), ~4x faster
  on CPU than the transposed view of [N, K] (oneDNN s8s8s32 under the hood where it has it).
- "onednn" (one group only): torch.ops.onednn.qlinear_pointwise on a qlinear_prepack'ed weight, activations
  shifted to uint8 with zero point 128 (oneDNN's u8s8 form: VNNI/AMX-INT8; its s8 activations take a
  reference path ~200x slower).
- "float": the reference and the fallback that runs anywhere: the same integer math as float32 matmuls
  (exact while a row's sum stays under 2^24, i.e. always but at the extremes; a matmul per group), and what
  runs under BATCHRUN_QUANT_KERNELS=0.
"""
from __future__ import annotations

import time
from typing import Optional

import torch
from torch import nn

from batchrun.kernels import cpu_w8a8
from batchrun.models.quant_weights import QuantizedWeight

KERNELS = ("own", "int_mm", "onednn", "float")
# row-count buckets: a product of m rows uses the kernel chosen for the first bucket >= m (the last beyond)
BUCKETS = (1, 16, 64, 256, 2048)
MEASURE_MAX_ROWS = 512        # the 2048 bucket is timed at this many rows: the cost per row is flat by then
GROUP = 64                    # the default columns per scale along K (quantization_group_size), where it divides K
ROTATION = 64                 # a Hadamard rotation of each block of this many columns along K, where it divides K


def rotates(k: int, rotate: bool = True) -> bool:
    """A projection of input size k takes the block rotation (rotate_blocks) when asked and ROTATION divides k."""
    return rotate and k % ROTATION == 0


def rotate_blocks(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 -> x @ blockdiag(H, .., H) with H the normalized 64 x 64 Hadamard matrix (symmetric and
    its own inverse), in place: a fast Walsh-Hadamard transform per block, butterflies of span 1, 2, .., 32 in
    that order (as the own kernel does them, so its codes are these bit for bit), then the exact 1/8.
    Rotating x and W alike leaves x @ W.T as it is, and spreads a block's outliers over all 64 columns: the
    int8 groups' absmax then sits near their typical values (QuaRot's idea, within blocks)."""
    m, k = x.shape
    h = 1
    while h < ROTATION:
        v = x.view(m, k // (2 * h), 2, h)
        a, b = v[:, :, 0], v[:, :, 1]
        lo, hi = a + b, a - b
        a.copy_(lo)
        b.copy_(hi)
        h *= 2
    return x.mul_(1 / ROTATION ** 0.5)


def group_for(k: int, group: int = GROUP) -> int:
    """The group a projection of input size k takes: `group` where it divides k, else k (one group; so does
    group 0)."""
    return group if group and k % group == 0 else k


def quantize_rows(x: torch.Tensor, inv_smooth: Optional[torch.Tensor] = None, group: Optional[int] = None,
                  rotate: bool = False):
    """x [M, K] (any float dtype) -> (qx int8 [M, K], sx float32 [M, K / group]) with x ~ qx * sx, symmetric
    per row and group of `group` columns (None: the whole row); with inv_smooth [K], of x * inv_smooth
    (SmoothQuant's run-time division); with rotate, of that rotated (rotate_blocks)."""
    x = x.to(torch.float32, copy=True) if inv_smooth is None else torch.mul(x, inv_smooth)   # ours to reuse
    if rotate:
        rotate_blocks(x)
    m, k = x.shape
    xg = x.view(m, k // (group or k), group or k)
    lo, hi = torch.aminmax(xg, dim=-1, keepdim=True)                         # one pass, no |x| temporary
    sx = torch.maximum(-lo, hi).div_(127).clamp_(min=1e-30)   # an all-zero row: codes 0 (few ops: decode)
    return xg.div_(sx).round_().to(torch.int8).view(m, k), sx.view(m, -1)   # |x / sx| <= 127 (+ an ulp)


def quantize_w8(w: torch.Tensor, group: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q int8 [N, K], scale float32 [N], or [N, K / group] with a group): symmetric per output
    channel (and group of `group` columns), round to nearest."""
    w = w.float()
    n, k = w.shape
    wg = w.view(n, k // (group or k), group or k)
    scale = wg.abs().amax(dim=2, keepdim=True) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(wg / scale).clamp_(-127, 127).to(torch.int8).view(n, k)
    return q, (scale.view(n) if group in (None, k) else scale.view(n, -1))


class W8A8Weight(QuantizedWeight):
    """qt int8 [K, N] (the codes K-major), scales float32 [N] (one group) or [N, G] (G groups along K),
    optional inv_smooth float32 [K] (x is multiplied by it before its quantization), rotate: the codes are of
    W @ R and x is rotated alike (rotate_blocks) after that multiply; linear(x, b) = x @ w.T + b in x's dtype,
    through the measured kernel."""

    kind = "w8a8"

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, inv_smooth: Optional[torch.Tensor] = None,
                 use_kernel: bool = True, rotate: bool = False):
        super().__init__(use_kernel)
        if rotate and not rotates(q.shape[1]):
            raise ValueError(f"W8A8Weight: rotate needs K a multiple of {ROTATION}, got {q.shape[1]}")
        self.rotate = rotate
        self._qt = q.t().contiguous()
        self._scales = scales.float().contiguous()
        self.inv_smooth = None if inv_smooth is None else inv_smooth.float().contiguous()
        self.shape = tuple(q.shape)
        self.group = q.shape[1] // (scales.shape[1] if scales.dim() == 2 else 1)   # columns per group
        self.per_bucket = ("float",) * len(BUCKETS)      # the reference; choose_kernels measures the others
        self._onednn = None                                # qlinear_prepack'ed codes, when a bucket uses them
        self._own = None                                   # cpu_w8a8.pack'ed codes, likewise

    @property
    def qt(self) -> torch.Tensor:
        """The codes int8 [K, N]; rebuilt from the own kernel's packed copy where only that one is kept."""
        if self._qt is not None:
            return self._qt
        return self._own.codes().t().contiguous()

    @property
    def scales(self) -> torch.Tensor:
        """float32 [N] or [N, G]; rebuilt from the own kernel's packed copy where only that one is kept."""
        return self._scales if self._scales is not None else self._own.row_scales()

    def keep_one_copy(self) -> None:
        """Once the own kernel runs every bucket, its packed codes and scales are the only copies kept (halves
        the bytes)."""
        if self.per_bucket == ("own",) * len(BUCKETS) and self.shape[1] % 4 == 0:
            self.own_packed()
            self._qt = self._scales = None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the product applies to the original x: q * scale, rotated back, times inv_smooth along K."""
        n, k = self.shape
        w = (self.qt.t().float().view(n, -1, self.group) * self.scales.view(n, -1, 1)).view(n, k)
        if self.rotate:
            rotate_blocks(w)                 # R is its own inverse
        return (w if self.inv_smooth is None else w * self.inv_smooth).to(dtype)

    def kernel_for(self, rows: int) -> str:
        if not self.use_kernel:
            return "float"
        return self.per_bucket[next((i for i, b in enumerate(BUCKETS) if rows <= b), len(BUCKETS) - 1)]

    @property
    def grouped(self) -> bool:
        return self.group < self.shape[1]

    def product(self, qx: torch.Tensor, sx: torch.Tensor, kernel: str) -> torch.Tensor:
        """qx int8 [M, K], sx [M, G] -> float32 [M, N] = sum over groups of sx * scales * (qx @ q.T) by
        `kernel`."""
        if kernel == "own" and self.shape[1] % 4 == 0:
            return cpu_w8a8.product(qx, sx, self.own_packed())
        if self.grouped:                     # torch's int8 GEMMs take one scale per row and output
            return self._grouped_float(qx, sx)
        if kernel == "own":                  # its layout takes K in fours: torch's kernel for this one
            kernel = "int_mm"
        if kernel == "int_mm":
            acc = torch._int_mm(qx, self.qt)
        elif kernel == "onednn":
            if self._onednn is None:
                self._onednn = torch.ops.onednn.qlinear_prepack(self.qt.t().contiguous(), None)
            zp = torch.zeros(self.shape[0], dtype=torch.int64)
            u8 = (qx.to(torch.int16) + 128).to(torch.uint8)
            return torch.ops.onednn.qlinear_pointwise(u8, 1.0, 128, self._onednn, self.scales, zp, None, 1.0, 0,
                                                      torch.float32, "none", [], "").mul_(sx)
        else:
            acc = qx.float() @ self.qt.float()
        return (acc * self.scales).mul_(sx)

    def _grouped_float(self, qx: torch.Tensor, sx: torch.Tensor) -> torch.Tensor:
        """The grouped product as float32 matmuls, a group at a time (exact integer sums, then the scales)."""
        out = torch.zeros(qx.shape[0], self.shape[0])
        for i, k0 in enumerate(range(0, self.shape[1], self.group)):
            acc = qx[:, k0:k0 + self.group].float() @ self.qt[k0:k0 + self.group].float()
            out += acc * (sx[:, i:i + 1] * self.scales[:, i])
        return out

    def own_packed(self) -> cpu_w8a8.Packed:
        """The codes in the own kernel's layout (packed once, on first use)."""
        if self._own is None:
            self._own = cpu_w8a8.pack(self.qt.t(), self.scales)
        return self._own

    def run(self, x2: torch.Tensor, kernel: str) -> torch.Tensor:
        """x2 [M, K] @ w.T in x2's dtype by `kernel` (the own one quantizes x2 itself)."""
        if kernel == "own" and x2.dtype in (torch.bfloat16, torch.float32) and x2.stride(-1) == 1 \
                and self.shape[1] % 4 == 0:
            return cpu_w8a8.linear(x2, self.own_packed(), self.inv_smooth, self.rotate)
        qx, sx = quantize_rows(x2, self.inv_smooth, self.group, self.rotate)
        return self.product(qx, sx, kernel).to(x2.dtype)

    def linear(self, x: torch.Tensor, b: Optional[torch.Tensor] = None) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        y = self.run(x2, self.kernel_for(x2.shape[0])).view(*x.shape[:-1], self.shape[0])
        return y if b is None else y + b

    def tensors(self) -> list[torch.Tensor]:
        extra = [self.inv_smooth] if self.inv_smooth is not None else []
        own = [self._own.wp, self._own.offset, self._own.scales] if self._own is not None else []
        codes = [self._qt] if self._qt is not None else []
        scales = [self._scales] if self._scales is not None else []
        return codes + scales + extra + ([self._onednn] if self._onednn is not None else []) + own


def _extreme_codes(n: int = 32, k: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight codes [n, k], activation codes [4, k]) at the ends of int8's range, every sign pattern: where a
    kernel without VNNI adds u8 x s8 pairs in int16 (VPMADDUBSW), 2 x 255 x 127 saturates it."""
    w = torch.full((n, k), 127, dtype=torch.int8)
    w[1::2] = -127
    w[2::4, ::2] = -127
    x = torch.full((4, k), 127, dtype=torch.int8)
    x[1] = -127
    x[2, ::2] = -127
    x[3, 1::2] = -127
    return w, x


def _candidates(grouped: bool = False) -> list[str]:
    """The kernels that run on this machine and are exact: each tried once on a random product and once on
    codes at the ends of the range, compared with "float" (exact here: |sums| < 2^24, unit scales). torch._int_mm
    on a CPU capped below VNNI (ATEN_CPU_CAPABILITY=avx2 with ONEDNN_MAX_CPU_ISA=AVX2, as the AVX2 kind runs)
    saturates on the second and so is not one. With groups (four of 16 here) only the own kernel is tried."""
    q = torch.randint(-127, 128, (32, 64), dtype=torch.int8)
    qe, xe = _extreme_codes()
    g = 4 if grouped else 1
    cases = []
    for codes, qx in ((q, quantize_rows(torch.randn(4, 64))[0]), (qe, xe)):
        w = W8A8Weight(codes, torch.ones(codes.shape[0], g) if grouped else torch.ones(codes.shape[0]))
        sx = torch.ones(qx.shape[0], g)
        cases.append((w, qx, sx, w.product(qx, sx, "float")))
    ok = []
    for k in ("own",) if grouped else KERNELS[:-1]:
        try:
            if all(torch.equal(w.product(qx, sx, k), ref) for w, qx, sx, ref in cases):
                ok.append(k)
        except (RuntimeError, NotImplementedError):      # not built into this torch / CPU
            pass
    return ok + ["float"]


def _time(fn, budget_s: float) -> float:
    fn()
    best, t0 = float("inf"), time.perf_counter()
    for _ in range(3):
        s = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - s)
        if time.perf_counter() - t0 > budget_s:
            break
    return best


def choose_kernels(weights: list[W8A8Weight], budget_s: float = 0.5,
                   dtype: torch.dtype = torch.bfloat16) -> dict[int, str]:
    """Time each candidate kernel on every distinct weight shape (weighted by how many layers have it) at
    each bucket's row count, and give every weight the fastest per bucket. Bounded: each timing stops after
    its share of budget_s. Returns {bucket: kernel}."""
    if not weights:
        return {}
    shapes: dict[tuple, list[W8A8Weight]] = {}
    for w in weights:
        shapes.setdefault((w.shape, w.group), []).append(w)
    for w in weights:                   # codes and scales back where only the own kernel's copies were kept
        w._qt, w._scales = w.qt, w.scales
    cands = _candidates(any(w.grouped for w in weights))
    share = budget_s / max(1, len(shapes) * len(BUCKETS) * len(cands))
    chosen = []
    for rows in BUCKETS:
        m = min(rows, MEASURE_MAX_ROWS)
        cost = dict.fromkeys(cands, 0.0)
        for (shape, _), ws in shapes.items():
            x = torch.randn(m, shape[1]).to(dtype)      # the whole product: quantizing x included
            for k in cands:
                cost[k] += len(ws) * _time(lambda: ws[0].run(x, k), share)
        chosen.append(min(cost, key=cost.get))
    for w in weights:
        w.per_bucket = tuple(chosen)
        w._onednn = w._own = None
        if "own" in chosen:
            w.own_packed()
            w.keep_one_copy()
        if "onednn" in chosen:          # packed now, so the ledger counts what the products will hold
            w._onednn = torch.ops.onednn.qlinear_prepack(w.qt.t().contiguous(), None)
    return dict(zip(BUCKETS, chosen))


def kernel_choice(model: nn.Module) -> dict[int, str]:
    """{bucket: kernel} of the model's W8A8 projections (empty when it has none): for the log and ledger."""
    w = next((m.weight for m in model.modules() if isinstance(getattr(m, "weight", None), W8A8Weight)), None)
    if w is None:
        return {}
    return {b: w.kernel_for(b) for b in BUCKETS}
