"""batchrun's Triton kernels (the CUDA attention path: K/V store, paged decode and prefill attention), each
beside the torch reference it is tested against. The CPU path's compiled ops are cpu_*.py.

Launchers check shapes, dtypes and strides and raise ValueError naming the argument. The *_ref functions
need only torch, so this package imports (and the references work) where Triton is missing: HAS_TRITON
is then False and the launchers raise RuntimeError. Triton kernels run on CUDA tensors, or on CPU tensors
when TRITON_INTERPRET=1 is set before this package is imported (a test path, not a fast one).
"""
from ._common import HAS_TRITON
from .kv_store import store_kv, store_kv_ref
from .paged_decode import DEFAULT_PARTITION_SIZE, num_partitions, paged_decode_attention, \
    paged_decode_attention_ref
from .paged_prefill import paged_prefill_attention, paged_prefill_attention_ref

__all__ = [
    "HAS_TRITON",
    "store_kv", "store_kv_ref",
    "paged_decode_attention", "paged_decode_attention_ref", "num_partitions", "DEFAULT_PARTITION_SIZE",
    "paged_prefill_attention", "paged_prefill_attention_ref",
]
