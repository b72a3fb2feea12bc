"""EngineConfig: every engine knob in one place, named as in vLLM."""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from typing import Any, Optional, Union

W8A8_DEFAULT_GROUP = 64    # models/w8a8.GROUP (this module imports no torch; a test holds them equal)


def quantization_group(quantization: Optional[str], group: Optional[int]) -> int:
    """quantization_group_size as set, or the kind's default where unset (None): w8a8 64, int4 128."""
    if group is not None:
        return group
    return W8A8_DEFAULT_GROUP if quantization == "w8a8" else 128


@dataclass
class EngineConfig:
    """Knobs of one engine replica. Names follow vLLM's so users can carry settings over.

    model: HF model directory (config.json, *.safetensors, tokenizer.json).
    dtype: "auto" (config.json's dtype), "bfloat16", "float16" or "float32".
    max_num_seqs: most sequences in one step's batch; None: the device's default (DEVICE_DEFAULTS).
    max_num_batched_tokens: token budget of one step (prefill chunks + decodes); None: the device's default.
    block_size: tokens per KV-cache block.
    max_model_len: longest prompt + output; default from config.json.
    kv_cache_memory: bytes for the KV cache on CPU (default: what max_num_seqs sequences of max_model_len
        need, at most half the available RAM; pages are touched only as blocks are first used).
    gpu_memory_utilization: share of GPU memory the engine may use (CUDA only).
    swap_space: GiB of host memory for swapped-out KV blocks (0 disables swapping). None: 4 on CUDA, 0 on
        CPU, where device memory is host memory and a second pool would only duplicate it (preemption
        recomputes); a value set explicitly allocates the pool on CPU too.
    preemption_mode: "swap" (swap out when worth it and the host pool has room, else recompute)
        or "recompute" (always drop the KV and recompute, as vLLM V1 does).
    swap_min_tokens: sequences with fewer computed tokens are recomputed rather than swapped
        (recomputing a short sequence is cheaper than two copies; see scripts/bench_swap.py).
    enable_prefix_caching: reuse KV blocks of identical prompt prefixes (on by default, as in vLLM V1: a
        batch's prompts share chat templates and system prompts; output is unchanged either way).
    speculative_config: {"method": "ngram", "num_speculative_tokens": k,
        "prompt_lookup_max": n_max, "prompt_lookup_min": n_min} or None.
    enforce_eager: disable CUDA graphs and torch.compile.
    compile: torch.compile the dense layer parts on CPU (norms, projections, RoPE, MLP); None: the device's
        default (DEVICE_DEFAULTS); enforce_eager=True turns it off.
    threads: torch intra-op threads (torch.set_num_threads); None: the cores this process may run on
        (os.sched_getaffinity), or $OMP_NUM_THREADS when set.
    attention_backend: "auto" (Triton on CUDA, torch on CPU), "torch" or "triton" (on CPU the Triton
        kernels run only under TRITON_INTERPRET=1: a test path, not a fast one).
    device: "auto", "cpu" or "cuda".
    seed: seed of the global sampler generator (requests with a seed use their own).
    quantization: weight-only quantization of the linear layers at load (models/quant.py): None, "int8"
        (per-output-channel symmetric), "int4" (group-wise asymmetric) or "gguf" (a GGUF file's Q4_0/Q4_1/Q8_0
        weights kept quantized); activations stay in `dtype`. torch's kernels on CPU, Triton's on CUDA.
    quantization_group_size: columns per scale along the input dim. int4: 32, 64 or 128 (it must divide every
        layer; None: 128). w8a8: 32, 64 or 128 where it divides a layer's input (a layer it does not takes one
        scale per row), or 0: one scale per row everywhere, per output channel and per token (faster, less
        exact; README "W8A8 and calibration"); None: 64.
    quantize_lm_head: quantize the logits weight too (a tied model keeps its embedding for lookups).
        quantization "w8a8": int8 weights (per output channel) and int8 activations (per token, dynamic), each
        with a scale per group of quantization_group_size (64) columns along K, int32 products
        (models/w8a8.py), channels balanced by SmoothQuant (models/smoothquant.py) from a calibration pass.
    quantization_calibration: the rows of that pass (models/calibration.py), which also sets an fp8 KV cache's
        per-layer k_scale / v_scale: a row count (None: 256 for w8a8; for fp8 KV alone, no pass: scales 1.0)
        taken from the job's prompts (an engine given none: the stdlib docstrings), or a file's path
        (JSONL / Parquet / text, a prompt per row). Cached by model and rows ($BATCHRUN_CALIBRATION_CACHE).
    tensor_parallel_size: ranks one model is split over (models/tp.py): heads and MLP rows sharded, one
        process per rank (gloo on CPU: each rank gets threads / size cores; NCCL on CUDA: GPU r), rank 0 in
        the engine's process. 1: no split.
    cpu_gemm: which implementation runs the bf16 projections on CPU (models/kernel_choice.py): "auto" (each
        weight shape and row-count bucket gets the fastest of batchrun's kernel, oneDNN and F.linear, timed at
        engine start on the loaded model and cached per CPU), or "own", "onednn", "plain" to force one
        (where it cannot hold a weight, the first that can). $BATCHRUN_CPU_GEMM sets it where this is auto.
    cpu_attention: which implementation runs attention on CPU (models/attention_choice.py): "auto" (fresh
        prompt chunks on torch's SDPA from the length where it was timed faster than batchrun's kernel at
        engine start, cached per CPU; float32 keeps batchrun's kernel), "own", "sdpa" (every fresh chunk) or
        "torch" (the reference path throughout). $BATCHRUN_CPU_ATTENTION sets it where this is auto.
    kv_cache_dtype: "auto" (the model's dtype), "fp8_e4m3" (alias "fp8") or "fp8_e5m2": K/V stored as float8
        with a per-layer k_scale / v_scale (1.0), converted in the attention op; half of bf16's bytes. "int8"
        (CPU only): int8 codes with a float16 scale per 32 values of each head's row (llama.cpp's q8_0
        cache), 53% of bf16's bytes at head_dim 64, closer to bf16 than fp8 (README "Quantization").
    """

    model: str = ""
    dtype: str = "auto"
    max_num_seqs: Optional[int] = None
    max_num_batched_tokens: Optional[int] = None
    block_size: int = 16
    max_model_len: Optional[int] = None
    kv_cache_memory: Optional[int] = None
    gpu_memory_utilization: float = 0.9
    swap_space: Optional[float] = None
    preemption_mode: str = "swap"
    swap_min_tokens: int = 16
    enable_prefix_caching: bool = True
    speculative_config: Optional[dict[str, Any]] = None
    enforce_eager: bool = False
    compile: Optional[bool] = None
    threads: Optional[int] = None
    attention_backend: str = "auto"
    device: str = "auto"
    seed: int = 0
    quantization: Optional[str] = None
    quantization_group_size: Optional[int] = None
    quantize_lm_head: bool = False
    quantization_calibration: Union[int, str, None] = None
    kv_cache_dtype: str = "auto"
    cpu_gemm: str = "auto"
    cpu_attention: str = "auto"
    tensor_parallel_size: int = 1
    trust_remote_code: bool = False  # accepted for vLLM compatibility; never executes code
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls) if f.name != "extra"]

    @property
    def group_size(self) -> int:
        """quantization_group_size, or the quantization kind's default where it is unset."""
        return quantization_group(self.quantization, self.quantization_group_size)

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.threads is not None and (isinstance(self.threads, bool) or self.threads < 1):
            raise ValueError(f"threads must be >= 1 (or null: the machine's cores), got {self.threads}")
        if self.swap_space is not None and self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 GiB, got {self.swap_space}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.preemption_mode not in ("swap", "recompute"):
            raise ValueError(f"preemption_mode must be 'swap' or 'recompute', got {self.preemption_mode!r}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"attention_backend must be auto, torch or triton, got {self.attention_backend!r}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.quantization not in (None, "int8", "int4", "gguf", "w8a8"):
            raise ValueError(f"quantization must be null, int8, int4, gguf or w8a8, got {self.quantization!r}")
        qc = self.quantization_calibration
        if not (qc is None or (isinstance(qc, str) and qc) or (type(qc) is int and qc >= 1)):
            raise ValueError(f"quantization_calibration must be a row count >= 1 or a file path, got {qc!r}")
        w8a8 = self.quantization == "w8a8"
        groups = (0, 32, 64, 128) if w8a8 else (32, 64, 128)
        g = self.quantization_group_size
        if g is not None and (type(g) is not int or g not in groups):
            raise ValueError(f"quantization_group_size must be {', '.join(map(str, groups[:-1]))} or {groups[-1]}"
                             f"{' for w8a8' if w8a8 else ''}, got {self.quantization_group_size!r}")
        if isinstance(self.tensor_parallel_size, bool) or not isinstance(self.tensor_parallel_size, int) \
                or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}")
        if self.cpu_gemm not in CPU_GEMM_MODES:
            raise ValueError(f"cpu_gemm must be one of {', '.join(CPU_GEMM_MODES)}, got {self.cpu_gemm!r}")
        if self.cpu_attention not in CPU_ATTENTION_MODES:
            raise ValueError(f"cpu_attention must be one of {', '.join(CPU_ATTENTION_MODES)}, "
                             f"got {self.cpu_attention!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")

    def resolved(self, device_type: str) -> "EngineConfig":
        """A copy with every device-dependent default (None) filled in for `device_type` ("cpu" or "cuda")."""
        d = DEVICE_DEFAULTS["cuda" if device_type == "cuda" else "cpu"]
        return replace(self, **{k: v for k, v in d.items() if getattr(self, k) is None},
                       extra=dict(self.extra))


def default_threads() -> int:
    """Threads for threads=None: $OMP_NUM_THREADS when set (launchers such as Ray set it per worker),
    else the cores this process may run on."""
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


# vLLM's names: "fp8" is fp8_e4m3 (torch.float8_e4m3fn); batchrun.kernels.kv_quant maps them to dtypes
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")
CPU_GEMM_MODES = ("auto", "own", "onednn", "plain")      # kernel_choice.MODES (that module imports torch)
CPU_ATTENTION_MODES = ("auto", "own", "sdpa", "torch")   # attention_choice.MODES

# Defaults of the knobs left None, per device.
# CPU: measured on SmolLM2-135M-Instruct (bf16) summarising stdlib docstrings (150-500-token chat
# prompts, max_tokens 64), 256 rows, a grid of max_num_seqs {16..256} x max_num_batched_tokens
# {512, 2048, 8192}: see the README's engine-knob table for the figures.
# CUDA: vLLM's defaults; a decode step is cheap next to its launch cost, so wide batches pay.
DEVICE_DEFAULTS: dict[str, dict[str, Any]] = {
    "cpu": {"max_num_seqs": 64, "max_num_batched_tokens": 2048, "swap_space": 0.0, "compile": False},
    "cuda": {"max_num_seqs": 256, "max_num_batched_tokens": 8192, "swap_space": 4.0, "compile": False},
}
