"""What a run writes about its rows: the result table of one unit (one output row per input row and sample,
in input order) and its done-marker stats. The summary of a finished run is job/report.py's."""
from __future__ import annotations

from typing import Any, Optional

import pyarrow as pa

from batchrun.connectors.secrets import redactor
from batchrun.job import logprob_columns
from batchrun.job.dedupe import shared_stats
from batchrun.job.logprob_columns import scored


def _row_params(spec, prep, i: int):
    rp = prep.rendered.params[i] if prep.rendered.params else None
    return rp if rp is not None else spec.sampling


def result_table(spec, prep, outs: list[Optional[Any]], shared: list[bool], tokenizer,
                 skip_special_tokens: bool = True) -> tuple[pa.Table, dict]:
    """Columns id, sample_index, output, finish_reason, error, prompt_tokens, output_tokens, shared, the
    passthrough columns, (include_prompt) prompt and the logprob columns (job/logprob_columns.py) when
    asked. One output row per sample: an input row with n samples gives n rows, sample_index 0..n-1 (an
    error row too). outs[i]: row i's RequestOutput, None when it never reached the engine
    (prep.rendered.errors[i] says why). An output shared by identical rows is decoded once."""
    r = prep.rendered
    n = prep.unit.num_rows
    samples = {id(c): c for o in outs if o is not None and o.finish_reason != "error" for c in (o.outputs or [o])}
    todo = [c for c in samples.values() if c.text is None]
    if todo:
        texts = tokenizer.decode_batch([c.token_ids for c in todo], skip_special_tokens=skip_special_tokens)
        for c, t in zip(todo, texts):
            c.text = t
    want_lp = spec.sampling.logprobs is not None or spec.input.format == "openai_batch"
    want_plp = spec.sampling.prompt_logprobs is not None
    keep, index, output, reason, error, ptok, otok, rows_shared = [], [], [], [], [], [], [], []
    lp, lp_top, plp, plp_top = [], [], [], []
    for i in range(n):
        o, p = outs[i], _row_params(spec, prep, i)
        ok = o is not None and o.finish_reason != "error"
        comps = (o.outputs or [o]) if ok else [None] * p.n
        prompt_lp = scored(o.prompt_token_ids, o.prompt_logprobs, p.prompt_logprobs or 0) if ok else (None, None)
        for k, c in enumerate(comps):
            keep.append(i); index.append(k); rows_shared.append(shared[i])  # noqa: E702
            ptok.append(0 if o is None else len(o.prompt_token_ids))
            output.append(c.text if ok else None); otok.append(len(c.token_ids) if ok else 0)  # noqa: E702
            reason.append(c.finish_reason if ok else "error")
            error.append(None if ok else (r.errors[i] if o is None else o.error or "error"))
            a, b = scored(c.token_ids, c.logprobs, p.logprobs or 0) if ok and c.logprobs is not None else (None, None)
            lp.append(a); lp_top.append(b); plp.append(prompt_lp[0]); plp_top.append(prompt_lp[1])  # noqa: E702
    take = pa.array(keep, pa.int64())
    if spec.input.id_column:
        ids = prep.table.column(spec.input.id_column).take(take)
    else:
        ids = pa.array([prep.unit.first_row + i for i in keep], pa.int64())
    if any(e is not None for e in error):       # an error row never carries a credential
        scrub = redactor()
        error = [None if e is None else scrub(e) for e in error]
    cols = {"id": ids, "sample_index": pa.array(index, pa.int32()), "output": pa.array(output, pa.string()),
            "finish_reason": pa.array(reason, pa.string()),
            "error": pa.array(error, pa.string()), "prompt_tokens": pa.array(ptok, pa.int32()),
            "output_tokens": pa.array(otok, pa.int32()), "shared": pa.array(rows_shared, pa.bool_())}
    for c in spec.input.passthrough:
        cols[c] = prep.table.column(c).take(take)
    if spec.output.include_prompt:
        cols["prompt"] = pa.array([r.prompts[i] for i in keep], pa.string())
    if want_lp or want_plp:
        cols |= logprob_columns.columns(lp, lp_top, plp if want_plp else None, plp_top)
    # a prompt counts once per input row, whatever its samples
    first = [ptok[j] if index[j] == 0 else 0 for j in range(len(keep))]
    stats = {"errors": reason.count("error"), "prompt_tokens": sum(first), "output_tokens": sum(otok),
             **shared_stats(rows_shared, first, otok)}
    return pa.table(cols), stats
