"""Logits processors with vLLM's semantics, batched over a step's rows: bad_words, min_tokens, logit_bias,
then the repetition, frequency and presence penalties (vLLM's order), all as tensor ops over [S, V].

The per-row Python work is over each row's own tokens, words and bias entries, never over the vocabulary,
and the penalties touch only the (row, token) entries they change: the rows' distinct output tokens with
their counts and, for a repetition penalty, their distinct prompt tokens (kept per sequence, computed
once), found by one numpy unique over the step's keys row * V + token; one gather, the float operations
of vLLM's dense form, one scatter. The model's raw logits are never changed: apply() returns a new tensor.
"""
from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence as Seq

import numpy as np
import torch


def bad_words_token_ids(words: Iterable[str], tokenizer: Any) -> list[list[int]]:
    """Each bad word's token ids, as vLLM tokenizes them: the word as is, and with one leading space when
    that gives a different first token in as many tokens (so the word is banned mid-text too)."""
    out: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if plain:
            out.append(list(plain))
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
            out.append(list(spaced))
    return out


class RowState:
    """What one sequence's processors keep between steps: its bad words' ids, its distinct prompt ids."""
    __slots__ = ("bad_words", "prompt_ids")

    def __init__(self, bad_words: Optional[list[list[int]]] = None):
        self.bad_words = bad_words or []
        self.prompt_ids: Optional[torch.Tensor] = None


def check_vocab(params: Any, bad_words: list[list[int]], vocab: int) -> Optional[str]:
    """A row-level error naming the key whose token ids fall outside [0, vocab), or None."""
    for t in (params.logit_bias or {}):
        if not 0 <= t < vocab:
            return f"logit_bias: token id {t} is outside the vocabulary [0, {vocab})"
    for ids in bad_words:
        if any(not 0 <= t < vocab for t in ids):
            return f"bad_words: a word's token ids fall outside the vocabulary [0, {vocab})"
    return None


def _state(seq) -> RowState:
    if seq.proc_state is None:
        seq.proc_state = RowState()
    return seq.proc_state


def apply(logits: torch.Tensor, seqs: Seq, eos_token_ids: Iterable[int] = ()) -> torch.Tensor:
    """logits [S, V] float32, seqs[i] the sequence of row i (its next token is scored) -> the processed
    logits (a new tensor; `logits` itself when no row has a processor)."""
    rows = [i for i, s in enumerate(seqs) if s.params.processed]
    if not rows:
        return logits
    logits = logits.clone()
    S, V = logits.shape
    dev = logits.device
    eos = list(eos_token_ids)
    ban_r: list[int] = []
    ban_t: list[int] = []
    bias_r: list[int] = []
    bias_t: list[int] = []
    bias_v: list[float] = []
    pen = []
    for i in rows:
        seq = seqs[i]
        p = seq.params
        out = seq.token_ids[seq.num_prompt_tokens:]
        for ids in _state(seq).bad_words:        # banned when the output ends with all ids but the last
            k = len(ids) - 1
            if k == 0 or (len(out) >= k and out[-k:] == ids[:-1]):
                ban_r.append(i)
                ban_t.append(ids[-1])
        if len(out) < p.min_tokens:
            stops = list(p.stop_token_ids) + ([] if p.ignore_eos else eos)
            ban_r += [i] * len(stops)
            ban_t += stops
        if p.logit_bias:
            bias_r += [i] * len(p.logit_bias)
            bias_t += list(p.logit_bias)
            bias_v += list(p.logit_bias.values())
        if p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0:
            pen.append(i)
    if ban_r:
        logits[torch.tensor(ban_r, device=dev), torch.tensor(ban_t, device=dev)] = float("-inf")
    if bias_r:
        logits.index_put_((torch.tensor(bias_r, device=dev), torch.tensor(bias_t, device=dev)),
                          torch.tensor(bias_v, device=dev, dtype=logits.dtype), accumulate=True)
    if pen:
        _penalties(logits, [seqs[i] for i in pen], torch.tensor(pen, device=dev), V)
    return logits


def _penalties(logits: torch.Tensor, seqs: list, rows: torch.Tensor, V: int) -> None:
    """vLLM's apply_penalties over the rows `rows` of logits, in place, on the (row, token) pairs it changes:
    each row's distinct prompt and output tokens, with their output counts (one numpy unique over the
    step's tokens). The same float operations as the dense [R, V] form, on those entries only."""
    dev, dt = logits.device, logits.dtype
    keys, out_keys = [], []
    for r, s in enumerate(seqs):
        base = r * V
        out_keys.append(np.asarray(s.token_ids[s.num_prompt_tokens:], dtype=np.int64) + base)
        if s.params.repetition_penalty != 1.0:
            st = _state(s)
            if st.prompt_ids is None:
                st.prompt_ids = np.unique(np.asarray(s.token_ids[:s.num_prompt_tokens], dtype=np.int64))
            keys.append(st.prompt_ids + base)
    out_all = np.concatenate(out_keys)
    uniq_out, counts = np.unique(out_all, return_counts=True)
    uniq = np.unique(np.concatenate(keys + [uniq_out])) if keys else uniq_out
    if not len(uniq):
        return
    c = np.zeros(len(uniq), dtype=np.float32)
    c[np.searchsorted(uniq, uniq_out)] = counts
    r_local = torch.from_numpy(uniq // V)
    tok = torch.from_numpy(uniq % V).to(dev)
    r = rows[r_local.to(dev)]
    cnt = torch.from_numpy(c).to(device=dev, dtype=dt)
    x = logits[r, tok]
    pick = r_local.to(dev)

    def per_row(name: str) -> torch.Tensor:
        return torch.tensor([getattr(s.params, name) for s in seqs], device=dev, dtype=dt)[pick]
    rep = per_row("repetition_penalty")
    x = torch.where(x > 0, x / rep, x * rep)     # rep 1 changes nothing; prompt tokens only where rep != 1
    x = x - per_row("frequency_penalty") * cnt
    x = x - per_row("presence_penalty") * (cnt > 0).to(dt)
    logits[r, tok] = x
