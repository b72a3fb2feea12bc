"""The engine with the Triton attention backend (kernels in Triton's interpreter on CPU) against HF.

Same flat mixed batches as on CUDA: decodes, chunked prefills over cached K/V, preemption; only the
kernels' execution differs. On a CUDA machine the same test runs the compiled kernels.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton is imported: CPU runs the interpreter

import pytest

from batchrun import LLM, SamplingParams
from conftest import hf_greedy, mixed_prompts

MAX_TOKENS = 12


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_triton_backend_greedy_matches_hf(hf_models, arch):
    path, hf = hf_models[arch]
    prompts = mixed_prompts(6, 120, seed=21)
    want = hf_greedy(hf, prompts, MAX_TOKENS)
    llm = LLM(path, dtype="float32", attention_backend="triton", max_num_batched_tokens=64)
    assert llm.engine.runner.backend.name == "triton"
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in outs] == want
