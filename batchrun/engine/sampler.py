"""Token sampling: greedy, temperature, top-k, top-p, min-p, with per-request seeds.

Non-greedy rows sample by the exponential race argmax(p / E), E ~ Exp(1): a seeded row draws E
from its own generator, so its tokens do not depend on what else shares the batch.
"""
from __future__ import annotations

from typing import Optional, Sequence as Seq

import torch

from batchrun.engine import logits_processors as processors
from batchrun.engine import structured
from batchrun.engine.logprobs import record_sampled


def process_logits(logits: torch.Tensor, seqs: Seq, eos_token_ids=()) -> torch.Tensor:
    """The one place a step's logits are post-processed before filtering and sampling: the logits
    processors (bad_words, min_tokens, logit_bias, penalties: engine/logits_processors.py), then
    constraints such as a structured-output token bitmask. `logits` itself is never changed (the raw
    logprobs are read from it)."""
    logits = processors.apply(logits, seqs, eos_token_ids)
    return structured.apply(logits, seqs)


def sample_seqs(logits: torch.Tensor, seqs: Seq, default_generator: Optional[torch.Generator] = None,
                eos_token_ids=()) -> list[int]:
    """One token per row for seqs[i] from raw logits [S, V]: processed, sampled with each sequence's params
    and generator; rows asking for logprobs get their entry (from the raw logits) in seq.logprobs."""
    tokens = sample(process_logits(logits, seqs, eos_token_ids), [s.params for s in seqs],
                    [s.generator for s in seqs], default_generator)
    record_sampled(logits, seqs, tokens)
    return tokens.tolist()


def _filter(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
            need_sort: bool, need_min_p: bool) -> torch.Tensor:
    # logits: [S, V] already divided by temperature; returns logits with filtered entries at -inf
    if need_sort:
        sorted_logits, idx = logits.sort(dim=-1, descending=True)
        V = logits.shape[-1]
        rank = torch.arange(V, device=logits.device)[None, :]
        k = torch.where(top_k > 0, top_k, V)[:, None]
        drop = rank >= k
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # keep the smallest prefix whose mass reaches top_p (the token crossing it stays)
        cum = probs.cumsum(dim=-1) - probs
        drop |= cum >= top_p[:, None]
        drop[:, 0] = False
        logits = torch.full_like(logits, float("-inf")).scatter(
            -1, idx, sorted_logits.masked_fill(drop, float("-inf")))
    if need_min_p:
        probs = logits.softmax(dim=-1)
        keep = probs >= min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(~keep, float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: Seq, generators: Seq[Optional[torch.Generator]],
           default_generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """logits [S, V] float32, one SamplingParams and one generator (or None) per row -> token ids [S]."""
    greedy = [p.temperature == 0.0 for p in params]
    tokens = logits.argmax(dim=-1)
    if all(greedy):
        return tokens
    rows = [i for i, g in enumerate(greedy) if not g]
    dev = logits.device
    sub = logits[rows]
    temp = torch.tensor([params[i].temperature for i in rows], device=dev, dtype=sub.dtype)
    top_k = torch.tensor([params[i].top_k for i in rows], device=dev)
    top_p = torch.tensor([params[i].top_p for i in rows], device=dev, dtype=sub.dtype)
    min_p = torch.tensor([params[i].min_p for i in rows], device=dev, dtype=sub.dtype)
    need_sort = any(params[i].top_k > 0 or params[i].top_p < 1.0 for i in rows)
    need_min_p = any(params[i].min_p > 0.0 for i in rows)
    sub = _filter(sub / temp[:, None], top_k, top_p, min_p, need_sort, need_min_p)
    probs = sub.softmax(dim=-1)
    noise = torch.empty_like(probs)
    for j, i in enumerate(rows):
        noise[j].exponential_(generator=generators[i] if generators[i] is not None else default_generator)
    tokens[rows] = (probs / noise).argmax(dim=-1)
    return tokens


def filtered_probs(logits: torch.Tensor, p) -> torch.Tensor:
    """[R, V] logits of one request -> its sampling distribution after temperature and filters."""
    R = logits.shape[0]
    dev = logits.device
    x = _filter(logits / p.temperature, torch.full((R,), p.top_k, device=dev),
                torch.full((R,), p.top_p, device=dev, dtype=logits.dtype),
                torch.full((R,), p.min_p, device=dev, dtype=logits.dtype),
                p.top_k > 0 or p.top_p < 1.0, p.min_p > 0.0)
    return x.softmax(dim=-1)


def _race(probs: torch.Tensor, generator: Optional[torch.Generator]) -> int:
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / noise).argmax())


def verify_sampled(logits: torch.Tensor, draft: list[int], p, generator: Optional[torch.Generator]) -> list[int]:
    """Speculative sampling for a deterministic draft (q = point mass on the draft token).

    logits [d+1, V]: row j scores the token after draft[:j]. Accept draft[j] with probability p_j(draft[j]);
    on rejection sample from p_j with draft[j] removed (the residual max(p - q, 0), renormalised); if all
    are accepted, sample the bonus token from p_d. The output distribution equals plain sampling.
    """
    probs = filtered_probs(logits, p)
    d, dev = len(draft), logits.device
    accept_p = probs[torch.arange(d, device=dev), torch.tensor(draft, device=dev)]
    accepted = (torch.rand(d, generator=generator, device=dev) < accept_p).tolist()
    for j, ok in enumerate(accepted):
        if not ok:
            residual = probs[j].clone()
            residual[draft[j]] = 0.0
            return draft[:j] + [_race(residual, generator)]
    return draft + [_race(probs[d], generator)]


def verify_drafts(logits: torch.Tensor, drafts: dict, default_generator: Optional[torch.Generator]) -> dict:
    """drafts: key -> (sequence, its draft tokens, its first row in logits), the d + 1 rows from there scoring
    the tokens after draft[:j]. Returns key -> the accepted drafts and the model's own next token: greedy
    sequences keep the longest prefix the argmax agrees with (one argmax over all rows, one host sync),
    sampled ones go through verify_sampled with their own generator."""
    result = {}
    greedy = [k for k, (seq, _, _) in drafts.items() if seq.params.greedy]
    if greedy:
        argmax = logits.argmax(dim=-1).tolist()
        for k in greedy:
            _, draft, r0 = drafts[k]
            a = 0
            while a < len(draft) and draft[a] == argmax[r0 + a]:
                a += 1
            result[k] = draft[:a] + [argmax[r0 + a]]
    for k, (seq, draft, r0) in drafts.items():
        if k not in result:
            result[k] = verify_sampled(logits[r0:r0 + 1 + len(draft)], draft, seq.params,
                                       seq.generator or default_generator)
    return result
