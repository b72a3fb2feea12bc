"""Rotary position embedding frequencies: default, linear and llama3 scaling, read from config.json."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:    # rope_params (models/args.py, a plan's config check) needs no torch
    import torch


class RopeError(ValueError):
    pass


# rope type -> the keys its frequencies need
_NEEDS = {"default": ("rope_theta",), "linear": ("rope_theta", "factor"),
          "llama3": ("rope_theta", "factor", "low_freq_factor", "high_freq_factor",
                     "original_max_position_embeddings")}


def rope_params(cfg: dict[str, Any]) -> dict[str, Any]:
    """Merge the two spellings HF has used: `rope_theta` + `rope_scaling` (<=4.x) and `rope_parameters` (5.x)."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    params.update({k: v for k, v in scaling.items() if k not in params})
    params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    params["rope_type"] = rope_type
    if rope_type not in _NEEDS:
        raise RopeError(f"rope type {rope_type!r} is not supported (default, linear, llama3)")
    for key in _NEEDS[rope_type]:
        if not isinstance(params.get(key), (int, float)) or isinstance(params.get(key), bool) or params[key] <= 0:
            raise RopeError(f"rope_scaling: {rope_type} needs key {key!r} as a positive number, got {params.get(key)!r}")
    if rope_type == "llama3" and params["high_freq_factor"] <= params["low_freq_factor"]:
        raise RopeError(f"rope_scaling: llama3 needs high_freq_factor > low_freq_factor, got "
                        f"{params['high_freq_factor']} <= {params['low_freq_factor']}")
    return params


def inv_frequencies(head_dim: int, params: dict[str, Any], device=None) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies after scaling (params from rope_params)."""
    import torch
    base = float(params["rope_theta"])
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (base ** exponents)
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


def cos_sin_cache(head_dim: int, params: dict[str, Any], max_positions: int, device=None) -> torch.Tensor:
    """[max_positions, head_dim] float32 on `device` (default: torch's current one): cos in the first half,
    sin in the second."""
    import torch
    inv_freq = inv_frequencies(head_dim, params, device)
    t = torch.arange(max_positions, dtype=torch.float32, device=device)
    freqs = torch.outer(t, inv_freq)              # [P, D/2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)
