"""batchrun's Triton kernels, each beside the torch reference it is tested against.

Launchers check shapes, dtypes and strides and raise ValueError naming the argument. The *_ref functions
need only torch, so this package imports (and the references work) where Triton is missing: HAS_TRITON
is then False and the launchers raise RuntimeError. Triton kernels run on CUDA tensors, or on CPU tensors
when TRITON_INTERPRET=1 is set before this package is imported (a test path, not a fast one).
"""
from ._common import HAS_TRITON
from .activation import silu_and_mul, silu_and_mul_ref
from .block_copy import copy_blocks, copy_blocks_ref, swap_blocks, swap_blocks_ref
from .kv_store import store_kv, store_kv_ref
from .paged_decode import DEFAULT_PARTITION_SIZE, num_partitions, paged_decode_attention, \
    paged_decode_attention_ref
from .paged_prefill import paged_prefill_attention, paged_prefill_attention_ref
from .rmsnorm import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_ref
from .rotary import rope_cos_sin_cache, rope_inv_freq, rotary_embedding, rotary_embedding_ref

__all__ = [
    "HAS_TRITON",
    "store_kv", "store_kv_ref",
    "paged_decode_attention", "paged_decode_attention_ref", "num_partitions", "DEFAULT_PARTITION_SIZE",
    "paged_prefill_attention", "paged_prefill_attention_ref",
    "rms_norm", "rms_norm_ref", "fused_add_rms_norm", "fused_add_rms_norm_ref",
    "rotary_embedding", "rotary_embedding_ref", "rope_inv_freq", "rope_cos_sin_cache",
    "silu_and_mul", "silu_and_mul_ref",
    "swap_blocks", "swap_blocks_ref", "copy_blocks", "copy_blocks_ref",
]
