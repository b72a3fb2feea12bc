"""logprobs and prompt_logprobs against HF float32: the raw distribution (log_softmax of HF's logits, before
temperature and penalties) within 1e-4, top-k ids and ranks as HF's order says, under chunked prefill,
preemption and prefix caching (a prompt_logprobs row computes its whole prompt)."""
import pytest
import torch

from batchrun import LLM, SamplingParams
from batchrun.outputs import MAX_LOGPROBS
from conftest import mixed_prompts

TOL = 1e-4


@pytest.fixture(scope="module")
def model(hf_models):
    return hf_models["llama"]


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """[len(ids), V]: row j the log-distribution of the token after ids[:j + 1]."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def check_position(d: dict, want: torch.Tensor, token: int, k: int):
    """d: one position's {token id: Logprob}: the scored token, and HF's top k in HF's order with their ranks."""
    assert abs(d[token].logprob - want[token].item()) < TOL
    assert d[token].rank == int((want >= want[token]).sum())
    got_top = sorted((t for t in d if d[t].rank <= k), key=lambda t: d[t].rank)
    assert got_top == want.topk(k).indices.tolist()
    assert [d[t].rank for t in got_top] == list(range(1, k + 1))
    assert all(abs(d[t].logprob - want[t].item()) < TOL for t in got_top)
    assert len(d) == k + (d[token].rank > k)


@pytest.mark.parametrize("params", [
    dict(temperature=0.0),
    dict(temperature=0.7, seed=11, top_k=20),                 # raw: temperature and top-k do not change them
    dict(temperature=0.0, repetition_penalty=1.5, presence_penalty=0.5),   # nor do the penalties
], ids=["greedy", "sampled", "penalised"])
def test_sampled_logprobs_are_hf_raw_log_softmax(model, params):
    path, hf = model
    llm = LLM(path, dtype="float32", max_num_seqs=8)
    prompts = mixed_prompts(4, 60, seed=2)
    k = 5
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=12, ignore_eos=True, logprobs=k, **params), use_tqdm=False)
    for p, o in zip(prompts, outs):
        c = o.outputs[0]
        assert len(c.logprobs) == len(c.token_ids) == 12
        want = hf_logprobs(hf, p + c.token_ids[:-1])[len(p) - 1:]
        for j, (t, d) in enumerate(zip(c.token_ids, c.logprobs)):
            check_position(d, want[j], t, k)
            assert d[t].decoded_token == llm.tokenizer.decode([t], skip_special_tokens=False)
        assert abs(c.cumulative_logprob - sum(want[j, t].item() for j, t in enumerate(c.token_ids))) < 1e-3
    if params["temperature"] == 0.0 and not params.get("repetition_penalty"):
        assert all(d[t].rank == 1 for o in outs for t, d in zip(o.token_ids, o.outputs[0].logprobs))


def test_logprobs_zero_gives_the_sampled_token_alone(model):
    path, _ = model
    llm = LLM(path, dtype="float32")
    o = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3, logprobs=0, seed=1),
                     use_tqdm=False)[0]
    assert [list(d) for d in o.outputs[0].logprobs] == [[t] for t in o.token_ids]


@pytest.mark.parametrize("engine", [
    dict(),
    dict(max_num_batched_tokens=24, block_size=8),                              # chunked prefill
    # 25 blocks of 8 tokens (K and V x 2 layers x 2 heads x 16 x float32 = 512 B a token): preemption
    dict(max_num_batched_tokens=48, block_size=8, max_model_len=160, kv_cache_memory=200 * 512, swap_space=0),
], ids=["plain", "chunked", "preempted"])
def test_prompt_logprobs_match_hf(model, engine):
    path, hf = model
    llm = LLM(path, dtype="float32", max_num_seqs=4, enable_prefix_caching=True, **engine)
    prompts = mixed_prompts(5, 120, seed=4)
    shared = prompts[2][:40]
    prompts += [shared + [9, 10, 11]]          # its prefix is cached by now: still scored, every position
    k = 3
    warm = llm.generate([{"prompt_token_ids": shared + [7]}], SamplingParams(max_tokens=2), use_tqdm=False)
    assert warm[0].finish_reason == "length"
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.0, prompt_logprobs=k),
                        use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert len(o.prompt_logprobs) == len(p) and o.prompt_logprobs[0] is None
        want = hf_logprobs(hf, p)
        for j in range(1, len(p)):
            check_position(o.prompt_logprobs[j], want[j - 1], p[j], k)
    if "kv_cache_memory" in engine:
        assert llm.stats["preemptions"] > 0


@pytest.mark.parametrize("key", ["logprobs", "prompt_logprobs"])
def test_above_the_cap_is_a_one_line_error(key):
    with pytest.raises(ValueError, match=rf"{key} must be an integer in \[0, {MAX_LOGPROBS}\]"):
        SamplingParams(**{key: MAX_LOGPROBS + 1})
    with pytest.raises(ValueError, match=key):
        SamplingParams(**{key: -1})
