"""The result table's logprob columns, shaped for DuckDB (README "Logprobs"):

    logprobs             list<struct<token_id int32, token string, logprob float32>>: the sampled tokens
    top_logprobs         list<list<struct<...>>>: per sampled token, the top k by rank
    prompt_logprobs      list<struct<...>>: each prompt token given its prefix; the first is null
    prompt_top_logprobs  list<list<struct<...>>>: per prompt token, the top k (the first: null)

e.g. `SELECT id, list_sum(list_transform(logprobs, lambda x: x.logprob)) AS seq_logprob FROM 'out/*.parquet'`.
Rows that did not ask (or failed) hold null. Values are the raw distribution's (SamplingParams).
"""
from __future__ import annotations

from typing import Optional

import pyarrow as pa

TOKEN = pa.struct([("token_id", pa.int32()), ("token", pa.string()), ("logprob", pa.float32())])
TOKENS = pa.list_(TOKEN)
TOP = pa.list_(pa.list_(TOKEN))


def _tok(t: int, lp) -> dict:
    return {"token_id": t, "token": lp.decoded_token, "logprob": lp.logprob}


def _top(d: dict, k: int) -> list[dict]:
    return [_tok(t, lp) for t, lp in sorted(d.items(), key=lambda kv: kv[1].rank)[:k]]


def scored(token_ids: list[int], positions: Optional[list], k: int) -> tuple[Optional[list], Optional[list]]:
    """(the scored tokens' structs, the top-k lists) of one row, from vLLM-shaped per-position dicts
    (positions[j] scores token_ids[j]; a None position gives null entries), or (None, None)."""
    if positions is None:
        return None, None
    toks, tops = [], []
    for t, d in zip(token_ids, positions):
        if d is None:
            toks.append(None)
            tops.append(None)
        else:
            toks.append(_tok(t, d[t]))
            tops.append(_top(d, k))
    return toks, tops


def columns(sampled: list, sampled_top: list, prompt: Optional[list], prompt_top: Optional[list]) -> dict:
    """Arrow columns from per-output-row lists; the prompt pair only when the job asks for them."""
    cols = {"logprobs": pa.array(sampled, TOKENS), "top_logprobs": pa.array(sampled_top, TOP)}
    if prompt is not None:
        cols |= {"prompt_logprobs": pa.array(prompt, TOKENS), "prompt_top_logprobs": pa.array(prompt_top, TOP)}
    return cols
