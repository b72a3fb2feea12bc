"""Whole-block copies of a KV pool [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim].

swap_blocks moves blocks between two pools (device <-> host for swapping): a Triton kernel cannot read
host memory that is not pinned and mapped, so this is the torch route, one gather and one scatter for all
layers, staged through pinned memory. copy_blocks copies blocks inside one pool on one device
(copy-on-write, defragmentation) with a Triton kernel, all layers and K/V in one launch.
"""
from __future__ import annotations

from typing import Sequence, Union

import torch

from ._common import FLOAT_DTYPES, HAS_TRITON, check, ready_to_launch

BlockIds = Union[Sequence[int], torch.Tensor]
_BLOCK = 1024

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _copy_blocks_kernel(pool_ptr, src_ptr, dst_ptr, num_blocks, BLOCK_NUMEL: tl.constexpr, BLOCK: tl.constexpr):
        pair = tl.program_id(0)
        lc = tl.program_id(1).to(tl.int64)         # (layer, K or V) plane
        chunk = tl.program_id(2)
        src = tl.load(src_ptr + pair)
        dst = tl.load(dst_ptr + pair)
        e = chunk * BLOCK + tl.arange(0, BLOCK)
        ok = e < BLOCK_NUMEL
        plane = lc * num_blocks
        vals = tl.load(pool_ptr + (plane + src) * BLOCK_NUMEL + e, mask=ok)
        tl.store(pool_ptr + (plane + dst) * BLOCK_NUMEL + e, vals, mask=ok)
else:
    _copy_blocks_kernel = None  # launchers raise before touching them


def _check_pool(op: str, name: str, pool) -> None:
    check(op, name, pool, dim=6, dtypes=FLOAT_DTYPES)
    if pool.shape[1] != 2:
        raise ValueError(f"{op}: {name} must be [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], "
                         f"got shape {list(pool.shape)}")


def _ids(op: str, name: str, ids: BlockIds, num_blocks: int) -> torch.Tensor:
    """Block ids as a CPU int64 tensor, range-checked (ids come from the host-side block manager)."""
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{op}: {name} must be a 1-D int32/int64 tensor, got {ids.dtype} {list(ids.shape)}")
        t = ids.to("cpu", torch.int64)
    else:
        try:
            t = torch.tensor(list(ids), dtype=torch.int64)
        except (TypeError, ValueError, RuntimeError) as e:
            raise ValueError(f"{op}: {name} must be a sequence of ints: {e}") from None
        if t.dim() != 1:
            raise ValueError(f"{op}: {name} must be a flat sequence of ints")
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= num_blocks):
        raise ValueError(f"{op}: {name} must lie in [0, {num_blocks}), got min {int(t.min())} max {int(t.max())}")
    return t


def _pairs(op, src_pool, dst_pool, src_ids, dst_ids):
    src = _ids(op, "src_block_ids", src_ids, src_pool.shape[2])
    dst = _ids(op, "dst_block_ids", dst_ids, dst_pool.shape[2])
    if src.numel() != dst.numel():
        raise ValueError(f"{op}: src_block_ids ({src.numel()}) and dst_block_ids ({dst.numel()}) differ in length")
    if dst.unique().numel() != dst.numel():
        raise ValueError(f"{op}: dst_block_ids repeat a block: {dst.tolist()}")
    return src, dst


def _check_pair_pools(op, src_pool, dst_pool):
    _check_pool(op, "src_pool", src_pool)
    _check_pool(op, "dst_pool", dst_pool)
    if src_pool.dtype != dst_pool.dtype:
        raise ValueError(f"{op}: src_pool is {src_pool.dtype} but dst_pool is {dst_pool.dtype}")
    s, d = list(src_pool.shape), list(dst_pool.shape)
    if s[:2] + s[3:] != d[:2] + d[3:]:
        raise ValueError(f"{op}: pools differ in more than num_blocks: src {s} vs dst {d}")


def swap_blocks(src_pool: torch.Tensor, dst_pool: torch.Tensor, src_block_ids: BlockIds,
                dst_block_ids: BlockIds) -> None:
    """dst_pool[:, :, dst_block_ids[i]] = src_pool[:, :, src_block_ids[i]] for every layer, K and V.

    The pools may sit on different devices (device pool <-> host pool) and differ in num_blocks. Blocks are
    gathered on the source device in one op, crossed through pinned host memory (host-to-device returns
    before the copy lands, on the current stream; device-to-host waits for it, since the host-side scatter
    needs the bytes), and scattered in one op.
    """
    op = "swap_blocks"
    _check_pair_pools(op, src_pool, dst_pool)
    src, dst = _pairs(op, src_pool, dst_pool, src_block_ids, dst_block_ids)
    if not src.numel():
        return
    gathered_shape = (*src_pool.shape[:2], src.numel(), *src_pool.shape[3:])
    dst_idx = dst.to(dst_pool.device)
    if src_pool.device == dst_pool.device:
        dst_pool.index_copy_(2, dst_idx, src_pool.index_select(2, src.to(src_pool.device)))
    elif src_pool.device.type == "cpu":        # host -> device
        staged = torch.empty(gathered_shape, dtype=src_pool.dtype, pin_memory=True)
        torch.index_select(src_pool, 2, src, out=staged)
        dst_pool.index_copy_(2, dst_idx, staged.to(dst_pool.device, non_blocking=True))
    elif dst_pool.device.type == "cpu":        # device -> host
        blocks = src_pool.index_select(2, src.to(src_pool.device))
        staged = torch.empty(gathered_shape, dtype=src_pool.dtype, pin_memory=True)
        staged.copy_(blocks, non_blocking=True)
        torch.cuda.current_stream(src_pool.device).synchronize()
        dst_pool.index_copy_(2, dst_idx, staged)
    else:                                      # device -> other device
        dst_pool.index_copy_(2, dst_idx, src_pool.index_select(2, src.to(src_pool.device)).to(dst_pool.device))


def swap_blocks_ref(src_pool: torch.Tensor, dst_pool: torch.Tensor, src_block_ids: BlockIds,
                    dst_block_ids: BlockIds) -> None:
    """Reference of swap_blocks: one block at a time."""
    op = "swap_blocks_ref"
    _check_pair_pools(op, src_pool, dst_pool)
    src, dst = _pairs(op, src_pool, dst_pool, src_block_ids, dst_block_ids)
    for s, d in zip(src.tolist(), dst.tolist()):
        dst_pool[:, :, d].copy_(src_pool[:, :, s])


def copy_blocks(kv_pool: torch.Tensor, src_block_ids: BlockIds, dst_block_ids: BlockIds) -> None:
    """kv_pool[:, :, dst[i]] = kv_pool[:, :, src[i]] on the pool's device, one Triton launch for all layers.

    kv_pool must be contiguous. dst ids must be distinct and not among the src ids (blocks are copied
    concurrently, so a chain a->b, b->c has to be split into two calls).
    """
    op = "copy_blocks"
    _check_pool(op, "kv_pool", kv_pool)
    check(op, "kv_pool", kv_pool, contiguous=True)
    src, dst = _pairs(op, kv_pool, kv_pool, src_block_ids, dst_block_ids)
    overlap = set(src.tolist()) & set(dst.tolist())
    if overlap:
        raise ValueError(f"{op}: blocks {sorted(overlap)} are both a source and a destination; "
                         f"split the copy into rounds")
    if not src.numel():
        return
    ready_to_launch(op, _copy_blocks_kernel, kv_pool.device)
    L, _, nb = kv_pool.shape[:3]
    block_numel = kv_pool[0, 0, 0].numel()
    block = min(_BLOCK, 1 << (block_numel - 1).bit_length())
    grid = (src.numel(), 2 * L, -(-block_numel // block))
    _copy_blocks_kernel[grid](kv_pool, src.to(kv_pool.device), dst.to(kv_pool.device), nb,
                              BLOCK_NUMEL=block_numel, BLOCK=block, num_warps=4)


def copy_blocks_ref(kv_pool: torch.Tensor, src_block_ids: BlockIds, dst_block_ids: BlockIds) -> None:
    """Torch reference of copy_blocks (index_select then index_copy_ along the block dim)."""
    op = "copy_blocks_ref"
    _check_pool(op, "kv_pool", kv_pool)
    src, dst = _pairs(op, kv_pool, kv_pool, src_block_ids, dst_block_ids)
    if src.numel():
        kv_pool.index_copy_(2, dst.to(kv_pool.device), kv_pool.index_select(2, src.to(kv_pool.device)))
