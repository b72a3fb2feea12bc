"""Sampler: filtered distributions against a naive reference, and per-request seeds independent of the batch."""
import numpy as np
import pytest
import torch

from batchrun import LLM, SamplingParams
from batchrun.engine.sampler import sample
from conftest import mixed_prompts

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])


def reference_probs(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """Naive: temperature, then top-k, then top-p over what is left, then min-p; renormalise."""
    x = logits / p.temperature
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    keep = np.zeros_like(probs, dtype=bool)
    k = p.top_k if p.top_k > 0 else len(probs)
    kept = order[:k]
    sub = probs[kept] / probs[kept].sum()
    mass = 0.0
    for idx, q in zip(kept, sub):
        keep[idx] = True
        mass += q
        if mass >= p.top_p:
            break
    probs = np.where(keep, probs, 0.0)
    probs /= probs.sum()
    if p.min_p > 0:
        probs = np.where(probs >= p.min_p * probs.max(), probs, 0.0)
        probs /= probs.sum()
    return probs


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.5),
    SamplingParams(temperature=1.0, top_k=3),
    SamplingParams(temperature=1.0, top_p=0.7),
    SamplingParams(temperature=2.0, top_k=5, top_p=0.8),
    SamplingParams(temperature=1.0, min_p=0.2),
], ids=["t1", "t0.5", "topk3", "topp0.7", "topk5-topp0.8", "minp0.2"])
def test_sampled_frequencies_match_reference(params):
    n = 20000
    gen = torch.Generator().manual_seed(0)
    logits = LOGITS.repeat(n, 1)
    tokens = sample(logits, [params] * n, [None] * n, gen)
    freq = np.bincount(tokens.numpy(), minlength=len(LOGITS)) / n
    want = reference_probs(LOGITS.numpy().astype(np.float64), params)
    assert np.all(freq[want == 0] == 0), f"filtered tokens were sampled: {freq} vs {want}"
    # 4.5 sigma of a binomial proportion at n=20000 is < 0.016
    assert np.abs(freq - want).max() < 0.016, f"{freq} vs {want}"


def test_greedy_rows_take_argmax_beside_sampled_rows():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=3)] * 3
    gens = [None, torch.Generator().manual_seed(3)] * 3
    out = sample(logits, params, gens, torch.Generator().manual_seed(0))
    assert out[0::2].tolist() == logits[0::2].argmax(-1).tolist()


def test_seeded_request_same_tokens_alone_and_in_mixed_batch(hf_models):
    path, _ = hf_models["llama"]
    llm = LLM(path, dtype="float32")
    prompt = mixed_prompts(1, 50, seed=7)[0][:50]
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=32, ignore_eos=True)
    alone = llm.generate([{"prompt_token_ids": prompt}], seeded, use_tqdm=False)[0].token_ids
    others = mixed_prompts(12, 200, seed=8)
    batch = [{"prompt_token_ids": p} for p in others[:6]] + [{"prompt_token_ids": prompt}] + \
            [{"prompt_token_ids": p} for p in others[6:]]
    params = [SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True)] * 3 + \
             [SamplingParams(temperature=0.7, seed=99, max_tokens=20, ignore_eos=True)] * 3 + [seeded] + \
             [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)] * 6
    mixed = llm.generate(batch, params, use_tqdm=False)[6].token_ids
    assert mixed == alone
    # a different seed gives a different sequence (32 tokens from a 512 vocab: a collision is ~impossible)
    other = SamplingParams(temperature=1.0, top_p=0.9, seed=4321, max_tokens=32, ignore_eos=True)
    assert llm.generate([{"prompt_token_ids": prompt}], other, use_tqdm=False)[0].token_ids != alone
