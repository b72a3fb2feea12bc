"""The whole-layer CPU op (kernels/cpu_decoder_layer.py) against its reference, the per-op path of
models/cpu_fused.py: bit-identical hidden states and KV caches at every step of real engine runs (prefill
chunks, decodes, speculative verification, prefix hits, sliding window), the same greedy tokens, the layers it
cannot take left to the per-op path, and bad arguments refused."""
from __future__ import annotations

import pytest
import torch

from batchrun import LLM, SamplingParams
from batchrun.kernels import cpu_decoder_layer
from batchrun.models import cpu_fused, kernel_choice as kc
from batchrun.models.attention_choice import ATTENTION_ENV
from conftest import mixed_prompts

pytestmark = pytest.mark.skipif(not cpu_decoder_layer.available(),
                                reason="the op composes the packed bf16 projections (AVX-512 BF16 or AVX2)")

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
# chunked prefill (64-token chunks), prefix caching (default), speculation; prompts past mistral's window of 96
KW = dict(dtype="bfloat16", max_num_seqs=6, max_num_batched_tokens=64, speculative_config=SPEC)
SHARED = [9, 8, 7, 6, 5, 4, 3, 2] * 5
PROMPTS = mixed_prompts(8, 200, seed=5) + [SHARED + [11, 12], SHARED + [13], [7, 8, 9, 10] * 12]
PARAMS = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def _generate(llm) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    return [o.token_ids for o in outs]


def _mixed(model, forms_by_shape, batch_hint):
    """kernel_choice.measure's times making each shape's forms win in turn per row-count bucket."""
    return {s: [[1.0 if i == b % len(fs) else 9.0 for i in range(len(fs))] for b in range(len(kc.ROWS))]
            for s, fs in forms_by_shape.items()}


@pytest.mark.parametrize("arch,gemm", [("llama", "own"), ("mistral", "own"), ("llama", "onednn"),
                                       ("llama", "plain"), ("llama", "mixed"), ("llama", "own+sdpa"),
                                       ("llama", "own+int8"), ("mistral", "own+fp8")])
def test_every_step_equals_the_per_op_path_bit_for_bit(hf_models, monkeypatch, arch, gemm):
    """Whichever form runs the projections (kernel_choice: own, oneDNN, plain, or per bucket), with fresh
    prompt chunks on torch's SDPA (attention_choice's sdpa), and with an int8 or float8 KV cache."""
    sdpa = gemm == "own+sdpa"
    kv = {"own+int8": "int8", "own+fp8": "fp8"}.get(gemm, "auto")
    gemm = "own" if kv != "auto" else gemm
    if sdpa:
        monkeypatch.setenv(ATTENTION_ENV, "sdpa")
        gemm = "own"
    if gemm == "mixed":
        monkeypatch.delenv(kc.GEMM_ENV, raising=False)
        monkeypatch.setenv(kc.CACHE_ENV, "0")
        monkeypatch.setattr(kc, "measure", _mixed)
    else:
        monkeypatch.setenv(kc.GEMM_ENV, gemm)
    llm = LLM(hf_models[arch][0], kv_cache_dtype=kv, **KW)
    assert llm.engine.memory_ledger["decoder_layer_op"] is True
    assert not sdpa or llm.engine.runner.backend.sdpa_from == 1
    model = llm.engine.runner.model
    steps = []

    def checked(model, h, rope, kv_caches, meta, backend):
        h_ref, kv_ref = h.clone(), kv_caches.clone()
        want = model.run_layers(h_ref, rope, kv_ref, meta, backend)
        got = cpu_fused.whole_layers(model, h, rope, kv_caches, meta, backend)
        assert torch.equal(got, want)
        assert torch.equal(kv_caches, kv_ref)
        steps.append((meta.num_decodes, meta.max_query_len))
        return got

    model._dense_fns = model._dense_fns._replace(layers=checked)
    _generate(llm)
    assert any(q > 1 and d == 0 for d, q in steps), "no prefill-only step"
    assert any(d > 0 for d, q in steps), "no decode step"
    assert any(1 < q <= 4 for d, q in steps), "no speculative verification"


def test_greedy_tokens_equal_the_per_op_path(hf_models, monkeypatch):
    path = hf_models["mistral"][0]
    with_op = _generate(LLM(path, **KW))
    monkeypatch.setenv(cpu_fused.LAYER_OP_ENV, "0")
    off = LLM(path, **KW)
    assert off.engine.memory_ledger["decoder_layer_op"] is False
    assert _generate(off) == with_op


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])    # q/k/v bias, q/k norms: the per-op path
def test_layers_it_cannot_take_keep_the_per_op_path(hf_models, arch):
    ledger = LLM(hf_models[arch][0], dtype="bfloat16").engine.memory_ledger
    assert ledger["fused_layer_ops"] is True and ledger["decoder_layer_op"] is False


def test_float32_keeps_the_per_op_path(hf_models):
    assert LLM(hf_models["llama"][0], dtype="float32").engine.memory_ledger["decoder_layer_op"] is False


def test_bad_arguments_are_refused(hf_models):
    llm = LLM(hf_models["llama"][0], dtype="bfloat16", max_num_seqs=2)
    model, kv = llm.engine.runner.model, llm.engine.runner.kv_caches
    w = model._layer_op_args[0][0][0]         # bucket 0 (one row), layer 0: its weights
    h = torch.zeros(1, 64, dtype=torch.bfloat16)
    cos_sin, pos = model.cos_sin, torch.zeros(1, dtype=torch.long)
    step = (torch.zeros(1, dtype=torch.long), torch.tensor([0, 1], dtype=torch.int32),
            torch.ones(1, dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="layer 7 is not one of 2"):
        cpu_decoder_layer.decoder_layer(h, w, kv, 7, cos_sin, pos, *step, 4, 1e-6, 0.25, -1)
    with pytest.raises(RuntimeError, match="do not match 8 heads"):
        cpu_decoder_layer.decoder_layer(h, w, kv, 0, cos_sin, pos, *step, 8, 1e-6, 0.25, -1)
    with pytest.raises(RuntimeError, match="contiguous bfloat16"):
        cpu_decoder_layer.decoder_layer(h.float(), w, kv, 0, cos_sin, pos, *step, 4, 1e-6, 0.25, -1)
    # the K/V prefetch before the projection reads the block table first: bad entries are left to the
    # attention's checks, never read past the table or the cache
    nblocks = kv.shape[2]
    bad_block = (*step[:3], torch.full((1, 1), nblocks + 5, dtype=torch.int32))
    with pytest.raises(RuntimeError, match=f"is not a block of the cache \\({nblocks} blocks"):
        cpu_decoder_layer.decoder_layer(h, w, kv, 0, cos_sin, pos, *bad_block, 4, 1e-6, 0.25, -1)
    too_long = (*step[:2], torch.full((1,), 10**6, dtype=torch.int32), step[3])
    with pytest.raises(RuntimeError, match="needs more than the 1 blocks"):
        cpu_decoder_layer.decoder_layer(h, w, kv, 0, cos_sin, pos, *too_long, 4, 1e-6, 0.25, -1)
