"""Shared launcher plumbing: the optional Triton import and argument checks that raise clear ValueErrors."""
from __future__ import annotations

from typing import Iterable, Optional

import torch

try:  # the references must import without Triton (CPU-only installs, macOS)
    import triton
    import triton.language as tl
    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised by a subprocess test
    triton = None
    tl = None
    HAS_TRITON = False

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def is_interpreted(kernel) -> bool:
    """True when `kernel` was decorated under TRITON_INTERPRET=1 (it then runs on CPU tensors)."""
    return type(kernel).__name__ == "InterpretedFunction"


def ready_to_launch(op: str, kernel, device: torch.device) -> None:
    """Raise unless `kernel` can run on tensors of `device`."""
    if not HAS_TRITON:
        raise RuntimeError(f"{op}: Triton is not installed; use {op}_ref (the torch reference) instead")
    if device.type != "cuda" and not is_interpreted(kernel):
        raise ValueError(f"{op}: tensors are on {device}, Triton kernels need CUDA tensors "
                         f"(on CPU only under TRITON_INTERPRET=1, set before importing batchrun.kernels)")


def check(op: str, name: str, t, *, dim: Optional[int] = None, dtypes: Optional[Iterable[torch.dtype]] = None,
          device: Optional[torch.device] = None, contiguous: bool = False, last_dim_contiguous: bool = False) -> None:
    """Validate one tensor argument of launcher `op`; every failure names the argument."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{op}: {name} must be {dim}-D, got shape {tuple(t.shape)}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if t.dtype not in dtypes:
            allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
            raise ValueError(f"{op}: {name} must have dtype {allowed}, got {str(t.dtype).replace('torch.', '')}")
    if device is not None and t.device != device:
        raise ValueError(f"{op}: {name} is on {t.device}, expected {device} like the other inputs")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{op}: {name} must be contiguous (strides {t.stride()} for shape {tuple(t.shape)})")
    if last_dim_contiguous and t.numel() and t.stride(-1) != 1:
        raise ValueError(f"{op}: {name} must have a contiguous last dimension, got strides {t.stride()}")


def check_shape(op: str, name: str, t: torch.Tensor, expected: tuple) -> None:
    """expected: a tuple of ints or None (any size)."""
    ok = t.dim() == len(expected) and all(e is None or s == e for s, e in zip(t.shape, expected))
    if not ok:
        want = "[" + ", ".join("*" if e is None else str(e) for e in expected) + "]"
        raise ValueError(f"{op}: {name} must have shape {want}, got {list(t.shape)}")


def check_range_on_host(op: str, name: str, t: torch.Tensor, lo: int, hi: int) -> None:
    """Check lo <= t < hi, only for CPU tensors: reading a device tensor would synchronise (and break graphs)."""
    if t.device.type == "cpu" and t.numel():
        tmin, tmax = int(t.min()), int(t.max())
        if tmin < lo or tmax >= hi:
            raise ValueError(f"{op}: {name} values must lie in [{lo}, {hi}), got min {tmin} max {tmax}")


def check_block_tables_on_host(op: str, block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                               num_blocks: int) -> None:
    """On CPU: every block a sequence uses (the first ceil(seq_len / block_size) entries) must exist.
    Entries past those are padding, never read, and may hold anything."""
    if block_tables.device.type != "cpu" or not block_tables.numel():
        return
    lens = seq_lens.long()
    if int(lens.min()) < 0 or int(lens.max()) > block_tables.shape[1] * block_size:
        raise ValueError(f"{op}: seq_lens must lie in [0, {block_tables.shape[1] * block_size}] "
                         f"(block_tables width {block_tables.shape[1]} x block_size {block_size}), "
                         f"got min {int(lens.min())} max {int(lens.max())}")
    used = torch.arange(block_tables.shape[1])[None, :] < (lens[:, None] + block_size - 1) // block_size
    ids = block_tables[used]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise ValueError(f"{op}: block_tables entries in use must lie in [0, {num_blocks}), "
                         f"got min {int(ids.min())} max {int(ids.max())}")
