"""What every model reader shares, whatever the file format: ModelError, ModelInfo (a model's metadata, read
before any weight), model_args (config -> ModelArgs) and fused_name (HF tensor names onto models/llama.py's
fused layout). loader.py (HF directories, and the dispatch by format) and gguf.py (GGUF files) build on it,
so imports run one way: loader -> gguf -> model_info.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from batchrun.models.args import ConfigError, ModelArgs

if TYPE_CHECKING:    # torch loads with the weights: inspect_model (a plan, `validate`, a refused submit) needs none
    import torch

# model.dtype's names -> the torch dtype's
DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16", "fp32": "float32",
          "bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32"}


class ModelError(ValueError):
    """A model directory that cannot be served; the message names the file or key."""


@dataclass
class ModelInfo:
    path: str
    architecture: str
    config: dict[str, Any]
    weight_files: list[str]
    num_params: int
    weights_bytes: int          # on disk
    max_model_len: int
    args: ModelArgs               # the typed view of `config`, read once
    format: str = "safetensors"   # or "gguf" (models/gguf.py)
    # on-disk tensor type ("BF16", "Q4_1", ...) -> (tensors, bytes)
    tensor_types: dict[str, tuple[int, int]] = field(default_factory=dict)
    identity: Optional[dict[str, Any]] = None   # GGUF: file name, size, header hash (the job fingerprint)

    @property
    def num_layers(self) -> int:
        return self.args.num_layers

    @property
    def num_kv_heads(self) -> int:
        return self.args.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.args.head_dim

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        from batchrun.kernels.kv_quant import row_bytes      # an int8 cache's rows carry their scales
        return 2 * self.num_layers * self.num_kv_heads * row_bytes(dtype, self.head_dim)

    def memory_bytes(self, dtype: torch.dtype) -> int:
        """Weights in memory once loaded: every parameter in `dtype` (GGUF tensors are dequantised)."""
        import torch
        return self.num_params * torch.empty((), dtype=dtype).element_size()

    def dtype_name(self, dtype: str = "auto") -> str:
        """model.dtype ("auto": the config's) as a torch dtype's name; ModelError if it names none."""
        if dtype == "auto":
            dtype = self.config.get("dtype") or self.config.get("torch_dtype") or "float32"
        if dtype not in DTYPES:
            raise ModelError(f"dtype {dtype!r} is not one of auto, float32, bfloat16, float16")
        return DTYPES[dtype]

    def torch_dtype(self, dtype: str = "auto") -> torch.dtype:
        import torch
        return getattr(torch, self.dtype_name(dtype))


def model_args(cfg: dict[str, Any], source: str) -> ModelArgs:
    """ModelArgs.from_config, its refusal a ModelError naming `source` and the key."""
    try:
        return ModelArgs.from_config(cfg, source)
    except ConfigError as e:
        raise ModelError(str(e)) from e


def fused_name(name: str) -> tuple[str, int | None]:
    """HF name -> (our name, shard index within a fused tensor or None)."""
    if name.startswith("model."):
        name = name[len("model."):]
    for i, part in enumerate(("q_proj", "k_proj", "v_proj")):
        if f"self_attn.{part}." in name:
            return name.replace(f"self_attn.{part}.", "self_attn.qkv_proj."), i
    for i, part in enumerate(("gate_proj", "up_proj")):
        if f"mlp.{part}." in name:
            return name.replace(f"mlp.{part}.", "mlp.gate_up_proj."), i
    return name, None
