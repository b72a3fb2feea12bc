"""GPTQ rounding for W8A8's weights: codes chosen so the layer's output error on calibration inputs is small,
not each weight's own error (Frantar et al. 2022), on a block-diagonal Hessian.

The calibration pass (models/calibration.py) sums H = X^T X of each projection's input over its rows, kept
only in diagonal blocks of BLOCK columns ([ceil(K / BLOCK), BLOCK, BLOCK] float32: 1.7 MB per SmolLM2 layer
instead of 13 MB for the full matrices). quantize() then walks the columns of every block at once: each
column is rounded to its group's int8 grid, and its rounding error, weighted by the inverse Hessian's
Cholesky factor, is taken off the block's later columns, which round it away in turn. Scales are each group's
absmax / 127 when the walk reaches the group (the group's columns as updated by then), as in GPTQ; a group
wider than a block (one scale per row) takes its scale from the weight before the walk.

The blocks: on SmolLM2 (scripts/bench_quant.py, rotated W8A8 with groups of 64) blocks of 128 columns give
the top-1 agreement the full Hessian gives (97.1%), blocks of 64 not (96.9%); round to nearest gave 96.8%.
"""
from __future__ import annotations

import torch

BLOCK = 128          # columns per diagonal block of the Hessian
DAMP = 0.01          # the diagonal's share added to it (of its mean per block): GPTQ's default
STEP = 16            # columns rounded between two matmul updates of the rest of a block (divides every group)


def blocks_of(k: int) -> int:
    return -(-k // BLOCK)


def block_gram(x: torch.Tensor) -> torch.Tensor:
    """x [T, K] -> the diagonal blocks of x^T x, float32 [ceil(K / BLOCK), BLOCK, BLOCK] (K padded with zeros)."""
    t, k = x.shape
    xb = torch.nn.functional.pad(x.float(), (0, blocks_of(k) * BLOCK - k)).view(t, -1, BLOCK).transpose(0, 1)
    return xb.transpose(1, 2) @ xb                                       # [nb, B, T] @ [nb, T, B]


def change_basis(gram: torch.Tensor, k: int, factors: torch.Tensor, rotate: bool) -> torch.Tensor:
    """The blocks of x'^T x' for x' = x / factors (SmoothQuant's, [K]), then rotated per block of 64 when
    `rotate` (w8a8.rotate_blocks: its 64-blocks lie inside BLOCK's), from the blocks of x^T x."""
    from batchrun.models.w8a8 import ROTATION, rotate_blocks
    nb = gram.shape[0]
    f = torch.nn.functional.pad(1 / factors.float(), (0, nb * BLOCK - k), value=1.0).view(nb, BLOCK)
    h = gram * f[:, :, None] * f[:, None, :]
    if not rotate:
        return h
    r = torch.block_diag(*[rotate_blocks(torch.eye(ROTATION))] * (BLOCK // ROTATION))   # symmetric
    return r @ h @ r                             # K's padding: zero rows and columns, which stay zero


def quantize(w: torch.Tensor, gram: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float, gram [ceil(K / BLOCK), BLOCK, BLOCK] of its inputs -> (q int8 [N, K], scale float32 [N]
    for group == K, else [N, K / group]): w8a8.quantize_w8's form, the codes chosen by GPTQ."""
    return quantize_many([(w, gram)], group)[0]


@torch.no_grad()
def quantize_many(items: list, group: int, batch: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """quantize() of each (w, gram) of one shape. The blocks are independent, so those of `batch` weights are
    walked together (a few hundred small ops per call, not per weight), STEP columns at a time, the errors
    reaching the later columns by one matmul per step."""
    out = []
    for b in range(0, len(items), batch):
        chunk = items[b:b + batch]
        n, k = chunk[0][0].shape
        q, scale = _walk(torch.cat([w.float() for w, _ in chunk]), torch.cat([g for _, g in chunk]), k, group,
                         len(chunk))
        out += [(q[i * n:(i + 1) * n].clone(), scale[i * n:(i + 1) * n].clone()) for i in range(len(chunk))]
    return out


def _walk(w: torch.Tensor, gram: torch.Tensor, k: int, group: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """m weights stacked along N ([m N, K]) and their grams along the blocks ([m nb, B, B]): each weight's
    blocks walked against its own gram, all at once."""
    mn = w.shape[0]
    n = mn // m
    nb, pad = gram.shape[0] // m, gram.shape[0] // m * BLOCK - k
    wt = torch.nn.functional.pad(w, (0, pad)).view(m, n, nb, BLOCK).permute(0, 2, 3, 1).reshape(m * nb, BLOCK, n)
    h = gram.double().clone()
    diag = h.diagonal(dim1=1, dim2=2)
    dead = diag == 0                                       # a column no input reached (or K's padding)
    diag.add_(dead.double())
    diag.add_(DAMP * diag.mean(1, keepdim=True))
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).float()
    wt[dead] = 0
    walk = group <= BLOCK and BLOCK % group == 0           # groups inside blocks: scales as the walk gets there
    if walk:
        scale = torch.empty(m * nb, BLOCK // group, n)
    else:                                                  # one scale per row (or group) from the weight as given
        scale = w.view(mn, k // group, group).abs().amax(2) / 127
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        col_scale = torch.nn.functional.pad(scale.repeat_interleave(group, 1), (0, pad), value=1.0)
        col_scale = col_scale.view(m, n, nb, BLOCK).permute(0, 2, 3, 1).reshape(m * nb, BLOCK, n)
    q = torch.empty(m * nb, BLOCK, n)
    err = torch.empty(m * nb, STEP, n)
    for j in range(0, BLOCK, STEP):
        if walk and j % group == 0:
            s = wt[:, j:j + group].abs().amax(1) / 127
            scale[:, j // group] = torch.where(s > 0, s, torch.ones_like(s))
        for i in range(j, j + STEP):
            s = scale[:, i // group] if walk else col_scale[:, i]
            col = wt[:, i]                                                  # [m nb, N]
            qc = torch.round(col / s).clamp_(-127, 127)
            q[:, i] = qc
            e = err[:, i - j]
            torch.div(col - qc * s, u[:, i, i, None], out=e)
            wt[:, i + 1:j + STEP] -= u[:, i, i + 1:j + STEP, None] * e[:, None]
        wt[:, j + STEP:] -= u[:, j:j + STEP, j + STEP:].transpose(1, 2) @ err
    codes = q.view(m, nb, BLOCK, n).permute(0, 3, 1, 2).reshape(mn, -1)[:, :k].to(torch.int8).contiguous()
    if walk:
        scale = scale.view(m, nb, -1, n).permute(0, 3, 1, 2).reshape(mn, -1)[:, : k // group].contiguous()
    return codes, (scale.reshape(mn) if group == k else scale)
