"""n > 1 samples per prompt: sample k is exactly what n=1 with seed + k gives (its own seed stream), the prompt's
full blocks are computed once (the engine's computed_prompt_tokens counter), greedy samples agree with HF."""
import pytest

from batchrun import LLM, SamplingParams
from conftest import hf_greedy, mixed_prompts

N = 4


@pytest.fixture(scope="module")
def model(hf_models):
    return hf_models["llama"]


def test_each_sample_is_its_own_seed_stream(model):
    path, _ = model
    prompts = mixed_prompts(3, 80, seed=7)
    base = dict(max_tokens=10, temperature=1.0, ignore_eos=True)
    llm = LLM(path, dtype="float32", max_num_seqs=16, block_size=8)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(n=N, seed=100, **base),
                        use_tqdm=False)
    single = LLM(path, dtype="float32", max_num_seqs=16, block_size=8)
    for p, o in zip(prompts, outs):
        assert [c.index for c in o.outputs] == list(range(N))
        alone = single.generate([{"prompt_token_ids": p}] * N,
                                [SamplingParams(seed=100 + k, **base) for k in range(N)], use_tqdm=False)
        assert [c.token_ids for c in o.outputs] == [a.token_ids for a in alone]
        assert [c.text for c in o.outputs] == [a.text for a in alone]
        assert o.token_ids == o.outputs[0].token_ids and o.text == o.outputs[0].text
        assert len({tuple(c.token_ids) for c in o.outputs}) > 1      # the streams differ
        assert o.metrics.output_tokens == N * 10


def test_the_prompt_is_computed_once(model):
    path, hf = model
    bs = 8
    prompt = mixed_prompts(4, 200, seed=1)[2]        # 200 tokens: 25 full blocks
    llm = LLM(path, dtype="float32", max_num_seqs=8, block_size=bs)
    o = llm.generate([{"prompt_token_ids": prompt}],
                     SamplingParams(n=N, temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    want = hf_greedy(hf, [prompt], 6)[0]
    assert [c.token_ids for c in o.outputs] == [want] * N
    s = llm.stats
    # the first sample computes the prompt; each other one only what is past the last full block (>= 1 token)
    extra = len(prompt) - (len(prompt) - 1) // bs * bs
    assert s["computed_prompt_tokens"] == len(prompt) + (N - 1) * extra
    assert s["prefix_cache_hits"] == (N - 1) * (len(prompt) - extra)


def test_n_with_logprobs_and_the_outputs_of_other_requests(model):
    path, _ = model
    llm = LLM(path, dtype="float32", max_num_seqs=4)
    prompts = mixed_prompts(5, 40, seed=9)
    params = [SamplingParams(n=3, seed=5, max_tokens=5, logprobs=2, ignore_eos=True) if i % 2 else
              SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True) for i in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for o, sp in zip(outs, params):
        assert len(o.outputs) == sp.n
        for c in o.outputs:
            assert len(c.token_ids) == 5 and (sp.logprobs is None or len(c.logprobs) == 5)


@pytest.mark.parametrize("n", [0, -2, 1.5, True])
def test_bad_n_is_a_one_line_error(n):
    with pytest.raises(ValueError, match="n must be an integer >= 1"):
        SamplingParams(n=n)


@pytest.mark.parametrize("sampling, msg", [
    ({"n": -1}, "sampling: n must be an integer >= 1, got -1"),
    ({"logprobs": 25}, "sampling: logprobs must be an integer in [0, 20], got 25"),
    ({"prompt_logprobs": 21}, "sampling: prompt_logprobs must be an integer in [0, 20], got 21"),
    ({"presence_penalty": 3}, "sampling: presence_penalty must be in [-2, 2], got 3"),
    ({"logit_bias": {"x": 1}}, "sampling.logit_bias"),
])
def test_bad_job_sampling_exits_2_naming_the_key(tmp_path, sampling, msg):
    from batchrun.job.spec import JobError, parse_job
    from test_job_common import cli, job_dict, write_job
    job = job_dict("m", "in.parquet", "out", sampling=sampling)
    with pytest.raises(JobError) as e:
        parse_job(job, "<job>", str(tmp_path))
    assert msg in str(e.value) and "\n" not in str(e.value)
    if "n" in sampling:     # the CLI: exit 2, one line, before anything is read
        p = cli("submit", write_job(str(tmp_path / "job.yaml"), job), "--no-progress")
        assert p.returncode == 2 and msg in p.stderr and "Traceback" not in p.stderr


def test_progress_counts_every_samples_tokens(model):
    """The ETA's account (job/progress.py): an n=3 row is 3 x max_tokens of work and its samples' tokens all
    count; once it finished nothing is in flight, whatever the engine's decode counter says."""
    from batchrun.job.progress import EngineAccount
    path, _ = model
    llm = LLM(path, dtype="float32")
    sp = SamplingParams(n=3, seed=2, max_tokens=5, ignore_eos=True)
    (o,) = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], sp, use_tqdm=False)
    acc = EngineAccount()
    acc.admitted(sp.max_tokens * sp.n)
    acc.finished(o, sp.max_tokens * sp.n)
    assert acc.generated(llm.stats["decode_tokens"]) == (15, 0.0)
    assert llm.stats["decode_tokens"] == 3 * 4       # each sample's first token came with its prefill
