"""Tensor parallelism (Megatron-style) as a transform of a model, outside its math.

Rank r of `world` holds:
  qkv_proj, gate_up_proj   column-parallel: its query heads, its KV heads and its share of the intermediate
                           rows; with fewer KV heads than ranks each KV head is replicated on world/Hkv ranks
  o_proj, down_proj        row-parallel: the matching input columns; the partial products are summed over
                           ranks by one all-reduce each (RowParallelWeight), so every rank holds the full
                           hidden state after each projection
  embeddings, norms, head  replicated (every rank computes the logits; rank 0 samples)
The model is built from shard_args() (local head and intermediate counts: llama.py reads them like any
config) and loaded through weight_slice(), which names the slice of each on-disk tensor this rank reads.
The reference is the same model unsharded (tensor_parallel_size=1): results differ only in the order of the
float sums of the row-parallel products.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from batchrun.models.args import ModelArgs


def check_tensor_parallel(args: ModelArgs, world: int) -> None:
    """Sizes this model cannot be split into: a ValueError naming tensor_parallel_size."""
    if world < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {world}")
    if world == 1:
        return
    bad = [f"{name} {n}" for name, n in (("attention heads", args.num_heads),
                                          ("intermediate size", args.intermediate_size)) if n % world]
    kv = args.num_kv_heads
    if kv % world and world % kv:
        bad.append(f"KV heads {kv} (neither a multiple nor a divisor of it)")
    if bad:
        raise ValueError(f"tensor_parallel_size: {world} does not divide this model's {', '.join(bad)}")


def shard_args(args: ModelArgs, world: int) -> ModelArgs:
    """The hyper-parameters of one rank's shard."""
    if world == 1:
        return args
    return replace(args, num_heads=args.num_heads // world, num_kv_heads=max(1, args.num_kv_heads // world),
                   intermediate_size=args.intermediate_size // world)


def _kv_heads(args: ModelArgs, rank: int, world: int) -> tuple[int, int]:
    """(first KV head, count) of rank `rank`: its query heads' KV heads."""
    if args.num_kv_heads >= world:
        n = args.num_kv_heads // world
        return rank * n, n
    return rank * args.num_kv_heads // world, 1


def weight_slice(hf_name: str, args: ModelArgs, rank: int, world: int) -> Optional[tuple[int, int, int]]:
    """(dim, start, length) of the on-disk tensor `hf_name` that rank `rank` holds; None: the whole tensor."""
    if world == 1:
        return None
    d, inter = args.head_dim, args.intermediate_size // world
    q = args.num_heads // world
    if ".self_attn.q_proj." in hf_name:
        return 0, rank * q * d, q * d
    if ".self_attn.k_proj." in hf_name or ".self_attn.v_proj." in hf_name:
        first, n = _kv_heads(args, rank, world)
        return 0, first * d, n * d
    if ".self_attn.o_proj.weight" in hf_name:
        return 1, rank * q * d, q * d
    if ".mlp.gate_proj." in hf_name or ".mlp.up_proj." in hf_name:
        return 0, rank * inter, inter
    if ".mlp.down_proj.weight" in hf_name:
        return 1, rank * inter, inter
    return None


class RowParallelWeight:
    """A row-parallel projection's local weight (plain, packed or quantized: cpu_linear.linear runs it);
    linear() sums the partial products over the group, then adds the (replicated) bias once."""

    def __init__(self, local, group=None):
        self.local = local
        self.group = group

    def linear(self, x: torch.Tensor, b: Optional[torch.Tensor] = None) -> torch.Tensor:
        from batchrun.models.cpu_linear import linear
        y = linear(x, self.local)
        dist.all_reduce(y, group=self.group)
        return y if b is None else y.add_(b)

    @property
    def nbytes(self) -> int:
        w = self.local
        return w.nbytes if not isinstance(w, torch.Tensor) else w.numel() * w.element_size()


def row_parallel_layers(model: nn.Module) -> list[nn.Linear]:
    return [m for layer in model.layers for m in (layer.self_attn.o_proj, layer.mlp.down_proj)]


def apply_tensor_parallel(model: nn.Module, group=None) -> None:
    """Make o_proj and down_proj of a loaded shard all-reduce their outputs (after any packing or
    quantization of the local weights, which this wraps)."""
    for mod in row_parallel_layers(model):
        w = mod._parameters.pop("weight", None)
        if w is None:                      # a buffer (packed) or a plain attribute (quantized)
            w = mod._buffers.pop("weight", None) if "weight" in mod._buffers else mod.__dict__.pop("weight")
        mod.weight = RowParallelWeight(w.detach() if isinstance(w, nn.Parameter) else w, group)
