"""Rotary position embedding frequencies: default, linear and llama3 scaling, read from config.json."""
from __future__ import annotations

import math
from typing import Any

import torch


class RopeError(ValueError):
    pass


def rope_params(cfg: dict[str, Any]) -> dict[str, Any]:
    """Merge the two spellings HF has used: `rope_theta` + `rope_scaling` (<=4.x) and `rope_parameters` (5.x)."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    params.update({k: v for k, v in scaling.items() if k not in params})
    params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    params["rope_type"] = rope_type
    if rope_type not in ("default", "linear", "llama3"):
        raise RopeError(f"config.json: rope type {rope_type!r} is not supported (default, linear, llama3)")
    return params


def inv_frequencies(head_dim: int, params: dict[str, Any]) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies after scaling."""
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = params["rope_type"]
    if kind == "linear":
        return inv_freq / float(params["factor"])
    if kind == "llama3":
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_len = float(params["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        # long wavelengths are slowed by `factor`, short ones kept, the band between interpolated
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


def cos_sin_cache(head_dim: int, params: dict[str, Any], max_positions: int) -> torch.Tensor:
    """[max_positions, head_dim] float32: cos in the first half, sin in the second."""
    inv_freq = inv_frequencies(head_dim, params)
    t = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)              # [P, D/2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)
