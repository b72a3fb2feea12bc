"""Swap preemption, prefix caching and n-gram speculation: each leaves greedy output token-identical to
HF transformers, alone and together, and the block pool stays exact (no leaks, cached blocks never
written, ref counts equal to the block-table references)."""
import random
from collections import Counter

import pytest
import torch

from batchrun import LLM, SamplingParams
from batchrun.models.loader import inspect_model
from conftest import VOCAB, hf_greedy, mixed_prompts

MAX_TOKENS = 48
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
        "disable_by_batch_size": None}


def workload():
    """32+ prompts: mixed lengths, a shared 100-token system prefix, and copy-heavy repeated spans."""
    rng = random.Random(5)
    system = [rng.randrange(3, VOCAB) for _ in range(100)]
    shared = [system + p for p in mixed_prompts(12, 120, seed=11)]
    copy = []
    for _ in range(8):
        span = [rng.randrange(3, VOCAB) for _ in range(rng.randint(8, 24))]
        copy.append(span * rng.randint(2, 5))
    return mixed_prompts(14, 300, seed=12) + shared + copy


@pytest.fixture(scope="module")
def oracle(hf_models):
    path, hf = hf_models["llama"]
    prompts = workload()
    return path, prompts, hf_greedy(hf, prompts, MAX_TOKENS)


class PoolInvariants:
    """Wraps the runner of an LLM: before every step, published (cached) blocks are snapshotted and
    after it compared; ref counts are checked against the live block tables."""

    def __init__(self, llm: LLM):
        self.eng = llm.engine
        self.steps_checked = 0
        runner = self.eng.runner
        inner = runner.execute

        def execute(out):
            pool = self.eng.kv.pool
            cached = [b for b in range(pool.num_blocks) if pool.block_key[b] is not None]
            snap = runner.kv_caches[:, :, cached].clone()
            # no scheduled write may land in a shared or published block
            bs = self.eng.kv.block_size
            for e in out.scheduled:
                s = e.seq
                for pos in range(s.num_computed_tokens, s.num_computed_tokens + e.num_new_tokens):
                    b = s.block_table[pos // bs]
                    assert pool.ref_counts[b] == 1, f"write into shared block {b}"
                    assert pool.block_key[b] is None, f"write into published block {b}"
            res = inner(out)
            assert torch.equal(runner.kv_caches[:, :, cached], snap), "a cached block changed"
            self.check_refcounts()
            self.steps_checked += 1
            return res

        runner.execute = execute

    def check_refcounts(self):
        sch, pool = self.eng.scheduler, self.eng.kv.pool
        refs = Counter(b for s in sch.running for b in s.block_table)
        for b in range(pool.num_blocks):
            assert pool.ref_counts[b] == refs.get(b, 0), f"block {b}: ref {pool.ref_counts[b]} != {refs.get(b, 0)}"
        host = Counter(b for s in sch.swapped for b in s.host_blocks)
        if self.eng.kv.host_pool is not None:
            assert self.eng.kv.host_pool.num_used == sum(host.values())


def kv_budget(path, blocks):
    return blocks * 16 * inspect_model(path).kv_bytes_per_token(torch.float32)


# Tight budgets: 48 blocks (768 tokens) against a working set of many sequences; max_model_len 512 so the
# cache holds one whole sequence. Swap is asked for explicitly (swap_space): on CPU the default allocates
# no host pool and preemption recomputes.
TIGHT = {"kv_blocks": 48, "max_model_len": 512}
OFF = {"enable_prefix_caching": False}     # on by default: each feature alone has it off
FEATURES = {
    "baseline": {**OFF},
    "swap": {**OFF, **TIGHT, "preemption_mode": "swap", "swap_space": 0.01, "swap_min_tokens": 0},
    "recompute": {**OFF, **TIGHT, "preemption_mode": "recompute"},
    "default_preemption": {**OFF, **TIGHT},
    "prefix_caching": {"enable_prefix_caching": True},
    "speculation": {**OFF, "speculative_config": SPEC},
    "all_three": {**TIGHT, "preemption_mode": "swap", "swap_space": 0.01, "swap_min_tokens": 0,
                  "enable_prefix_caching": True, "speculative_config": SPEC, "max_num_batched_tokens": 96},
}


@pytest.mark.parametrize("feature", list(FEATURES))
def test_feature_is_output_neutral_and_pool_exact(oracle, feature):
    path, prompts, want = oracle
    kw = dict(FEATURES[feature])
    if "kv_blocks" in kw:
        kw["kv_cache_memory"] = kv_budget(path, kw.pop("kv_blocks"))
    llm = LLM(path, dtype="float32", **kw)
    inv = PoolInvariants(llm)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True), use_tqdm=False)
    bad = [i for i, (o, w) in enumerate(zip(outs, want)) if o.token_ids != w]
    assert not bad, f"{feature}: prompts {bad} differ from HF"
    st = llm.stats
    assert inv.steps_checked == st["steps"]
    assert st["blocks_used"] == 0 and llm.engine.kv.pool.num_free == st["num_blocks"]
    if llm.engine.kv.host_pool is not None:
        assert llm.engine.kv.host_pool.num_used == 0
    if feature in ("swap", "all_three"):
        assert st["swapped_out_blocks"] > 0 and st["swapped_in_blocks"] == st["swapped_out_blocks"]
    if feature == "recompute":
        assert st["preemptions"] > 0 and st["recomputed_tokens"] > 0 and st["swapped_out_blocks"] == 0
    if feature == "default_preemption":
        # the device's default: on CPU no host pool (device memory is host memory), so preemption recomputes
        cpu = llm.engine.runner.device.type == "cpu"
        assert (llm.engine.kv.host_pool is None) == cpu and st["preemptions"] > 0
        if cpu:
            assert st["recomputed_tokens"] > 0 and st["swapped_out_blocks"] == 0
    if feature == "prefix_caching":
        assert st["prefix_cache_hits"] >= 11 * 96      # 11 of the 12 shared prompts reuse 6 blocks
    if feature == "all_three":
        assert st["prefix_cache_hits"] > 0             # fewer: a 48-block cache evicts under pressure
    if feature in ("speculation", "all_three"):
        assert st["spec_accepted"] > 0 and st["spec_proposed"] > st["spec_accepted"]


def test_speculative_sampling_keeps_the_distribution(hf_models, tmp_path):
    """Two-sample test: many seeded samples of a 16-token-vocabulary model, with and without speculation."""
    import transformers as tf
    from conftest import hf_config
    from batchrun.tokenizer import Tokenizer
    cfg = hf_config("llama")
    cfg.vocab_size = 16
    cfg.initializer_range = 0.3
    torch.manual_seed(3)
    tf.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    tok = Tokenizer.from_dir(hf_models["llama"][0])      # only decodes; ids stay below 16
    rng = random.Random(0)
    prompt = [rng.randrange(16) for _ in range(30)]     # every short n-gram recurs: drafts on most steps
    n, steps = 3000, 5
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=steps, ignore_eos=True) for i in range(n)]
    samples = {}
    stats = {}
    for name, spec in (("plain", None), ("spec", SPEC)):
        llm = LLM(str(tmp_path), dtype="float32", tokenizer=tok, max_num_seqs=256, speculative_config=spec)
        outs = llm.generate([{"prompt_token_ids": prompt}] * n, params, use_tqdm=False)
        samples[name] = [o.token_ids for o in outs]
        stats[name] = llm.stats
    assert stats["spec"]["spec_proposed"] > 1000 and stats["spec"]["spec_accepted"] > 100
    from scipy.stats import chi2_contingency
    for pos in range(steps):
        a = Counter(s[pos] for s in samples["plain"])
        b = Counter(s[pos] for s in samples["spec"])
        keys = sorted(set(a) | set(b))
        table = [[a.get(k, 0) + 0.5 for k in keys], [b.get(k, 0) + 0.5 for k in keys]]
        p_value = chi2_contingency(table)[1]
        assert p_value > 1e-3, f"position {pos}: distributions differ (p={p_value:.2e})"
    # pairs of consecutive tokens, where an accepted draft and its successor come from one step
    pa = Counter(tuple(s[1:3]) for s in samples["plain"])
    pb = Counter(tuple(s[1:3]) for s in samples["spec"])
    keys = [k for k in set(pa) | set(pb) if pa.get(k, 0) + pb.get(k, 0) >= 20]
    p_value = chi2_contingency([[pa.get(k, 0) + 0.5 for k in keys], [pb.get(k, 0) + 0.5 for k in keys]])[1]
    assert p_value > 1e-3
