"""The engine against HF transformers: logits within 1e-4 (float32) and token-identical greedy generation
on every architecture, also under budgets that force chunked prefill, queueing and preemption."""
import pytest
import torch

from batchrun import LLM, SamplingParams
from batchrun.engine.scheduler import ScheduledSeq, SchedulerOutput
from batchrun.engine.sequence import Sequence
from batchrun.models.loader import inspect_model
from conftest import ARCHS, hf_greedy, mixed_prompts

MAX_TOKENS = 64


def our_step_logits(llm: LLM, entries: list[tuple[Sequence, int]]) -> torch.Tensor:
    """Run one forward over (sequence, new tokens) pairs; logits at every token of the flat batch."""
    eng = llm.engine
    sched = []
    for seq, n in entries:
        assert eng.kv.allocate_slots(seq, n) is not None
        sched.append(ScheduledSeq(seq, n))
    runner = eng.runner
    ordered = sorted(sched, key=lambda e: e.num_new_tokens != 1)   # the runner's order
    ids, pos, meta = runner._prepare(ordered)
    with torch.inference_mode():
        h = runner.model(ids, pos, runner.kv_caches, meta, runner.backend)
        logits = runner.model.compute_logits(h)
    for e in sched:
        e.seq.num_computed_tokens += e.num_new_tokens
    # back to the caller's entry order
    out, start = {}, 0
    for e in ordered:
        out[id(e.seq)] = logits[start:start + e.num_new_tokens]
        start += e.num_new_tokens
    return [out[id(s)] for s, _ in entries]


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_chunk_and_decode_logits_match_hf(hf_models, arch):
    path, hf = hf_models[arch]
    llm = LLM(path, dtype="float32", block_size=8)
    prompts = mixed_prompts(3, 150, seed=1)
    a, b, c = (Sequence(str(i), p, None) for i, p in enumerate(prompts[2:] + prompts[:2]))
    la, lb = a.num_tokens, b.num_tokens
    # step 1: a's first chunk (not block-aligned) with b's whole prompt; step 2: a's rest, b decodes one
    # token, c prefills: one flat batch mixing a chunk over cached K/V, a decode and a fresh prefill
    s1 = our_step_logits(llm, [(a, 37), (b, lb)])
    b.token_ids.append(5)
    s2 = our_step_logits(llm, [(a, la - 37), (b, 1), (c, c.num_tokens)])
    with torch.no_grad():
        ref = {s.request_id: hf(torch.tensor([s.token_ids])).logits[0].float() for s in (a, b, c)}
    got_a = torch.cat([s1[0], s2[0]])
    got_b = torch.cat([s1[1], s2[1]])
    for name, got, want in (("a", got_a, ref["0"]), ("b", got_b, ref["1"]), ("c", s2[2], ref["2"])):
        err = (got - want).abs().max().item()
        assert err < 1e-4, f"{arch} seq {name}: max abs logit error {err}"


@pytest.fixture(scope="module")
def hf_outputs(hf_models):
    """HF generate, one prompt at a time (no padding): the oracle for every budget below."""
    prompts = mixed_prompts(32, 400)
    out = {}
    for arch in ARCHS:
        out[arch] = hf_greedy(hf_models[arch][1], prompts, MAX_TOKENS)
    return prompts, out


def kv_bytes_for_blocks(path, blocks, block_size=16):
    return blocks * block_size * inspect_model(path).kv_bytes_per_token(torch.float32)


BUDGETS = {
    "default": {},
    "chunked_prefill": {"max_num_batched_tokens": 48},
    "queueing": {"max_num_seqs": 3},
    # room for ~1.4 of the longest sequences at once; on CPU no host pool by default: preemption recomputes
    # (everything, prefix caching off: a readmitted sequence would reuse its own cached blocks)
    "preemption": {"kv_blocks": 40, "max_model_len": 512, "enable_prefix_caching": False},
}


@pytest.mark.parametrize("budget", list(BUDGETS))
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_generation_token_identical_to_hf(hf_models, hf_outputs, arch, budget):
    path, _ = hf_models[arch]
    prompts, expected = hf_outputs
    kwargs = dict(BUDGETS[budget])
    if "kv_blocks" in kwargs:
        kwargs["kv_cache_memory"] = kv_bytes_for_blocks(path, kwargs.pop("kv_blocks"))
    llm = LLM(path, dtype="float32", **kwargs)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    mismatched = [i for i, (o, e) in enumerate(zip(outs, expected[arch])) if o.token_ids != e]
    assert not mismatched, f"{arch}/{budget}: prompts {mismatched} differ from HF"
    assert all(o.finish_reason == "length" and len(o.token_ids) == MAX_TOKENS for o in outs)
    stats = llm.stats
    if budget == "preemption":
        assert stats["preemptions"] > 0
        if llm.engine.runner.device.type == "cpu":       # no host swap pool on CPU by default: recompute
            assert llm.engine.kv.host_pool is None and stats["recomputed_tokens"] > 0
    if budget == "chunked_prefill":
        assert stats["tokens_per_step"] <= 48
    assert stats["blocks_used"] == 0          # every block back in the pool
    assert llm.engine.kv.pool.num_free == stats["num_blocks"]
