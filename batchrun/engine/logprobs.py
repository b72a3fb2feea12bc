"""Log-probabilities of sampled and prompt tokens, from the raw distribution (vLLM's raw_logprobs):
log_softmax of the model's float32 logits before any processor, temperature or filter.

Each position is kept compactly as (token id, logprob, rank, top ids, top logprobs) until the request
finishes; to_position_dicts() turns them into vLLM's {token id: Logprob} dicts. rank is vLLM's: how many
tokens have a logprob >= the token's (1: the most likely).
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence as Seq

import torch

from batchrun.outputs import Logprob, PositionLogprobs

PROMPT_CHUNK_ROWS = 256       # prompt positions scored per log_softmax: bounds the [rows, V] temporaries

Entry = tuple  # (token id, logprob, rank, top ids, top logprobs)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, ks: Seq[int]) -> list[Entry]:
    """logits [R, V] raw, tokens [R] the token each row scores, ks[r] its top-k -> one Entry per row."""
    lp = logits.float().log_softmax(dim=-1)
    tok = lp.gather(1, tokens.view(-1, 1).to(lp.device)).view(-1)
    rank = (lp >= tok[:, None]).sum(dim=-1)
    kmax = max(ks) if ks else 0
    top_v, top_i = lp.topk(kmax, dim=-1) if kmax else (None, None)
    tokens_l, tok_l, rank_l = tokens.tolist(), tok.tolist(), rank.tolist()
    tv = top_v.tolist() if kmax else None
    ti = top_i.tolist() if kmax else None
    return [(tokens_l[r], tok_l[r], rank_l[r], ti[r][:k] if k else [], tv[r][:k] if k else [])
            for r, k in enumerate(ks)]


def record_sampled(raw: torch.Tensor, seqs: Seq, tokens: torch.Tensor) -> None:
    """Append the sampled token's Entry to seq.logprobs for each row whose params ask for logprobs."""
    rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    if not rows:
        return
    idx = torch.tensor(rows, device=raw.device)
    entries = token_logprobs(raw[idx], tokens[idx], [seqs[i].params.logprobs for i in rows])
    for i, e in zip(rows, entries):
        s = seqs[i]
        if s.logprobs is None:
            s.logprobs = []
        s.logprobs.append(e)


def record_prompt(compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                  seq, start: int, n: int, row0: int) -> None:
    """A prefill chunk of seq: tokens [start, start + n) at hidden rows [row0, row0 + n). Scores each
    prompt token whose prefix ends in the chunk, past those already scored (a recompute after
    preemption scores nothing twice), into seq.prompt_logprobs (entry j: prompt token j + 1)."""
    if seq.prompt_logprobs is None:
        seq.prompt_logprobs = []
    # entry j scores prompt token j + 1 from position j: positions below len() are scored already
    lo, hi = max(start, len(seq.prompt_logprobs)), min(start + n, seq.num_prompt_tokens - 1)
    k = seq.params.prompt_logprobs
    for a in range(lo, hi, PROMPT_CHUNK_ROWS):
        b = min(hi, a + PROMPT_CHUNK_ROWS)
        rows = torch.arange(row0 + a - start, row0 + b - start, device=hidden.device)
        targets = torch.tensor(seq.token_ids[a + 1:b + 1])
        seq.prompt_logprobs += token_logprobs(compute_logits(hidden[rows]), targets, [k] * (b - a))


def to_position_dicts(entries: Optional[list[Entry]], decode: Callable[[int], str]) -> Optional[list[PositionLogprobs]]:
    """Entries -> vLLM's per-position {token id: Logprob}: the scored token first, then the top k by rank."""
    if entries is None:
        return None
    out = []
    for tid, lp, rank, top_i, top_v in entries:
        d = {tid: Logprob(lp, rank, decode(tid))}
        for r, (t, v) in enumerate(zip(top_i, top_v), 1):
            if t not in d:
                d[t] = Logprob(v, r, decode(t))
        out.append(d)
    return out
