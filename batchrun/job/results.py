"""What a run writes about its rows: the result table of one unit (one output row per input row, in input
order) and its done-marker stats. The summary of a finished run is job/report.py's."""
from __future__ import annotations

from typing import Any, Optional

import pyarrow as pa

from batchrun.connectors.secrets import redactor
from batchrun.job.dedupe import shared_stats

def result_table(spec, prep, outs: list[Optional[Any]], shared: list[bool], tokenizer,
                 skip_special_tokens: bool = True) -> tuple[pa.Table, dict]:
    """Columns id, output, finish_reason, error, prompt_tokens, output_tokens, shared, the passthrough
    columns and (include_prompt) prompt. outs[i]: row i's RequestOutput, None when it never reached the
    engine (prep.rendered.errors[i] says why). An output shared by identical rows is decoded once."""
    r = prep.rendered
    n = prep.unit.num_rows
    todo = list({id(o): o for o in outs if o is not None and o.text is None and o.finish_reason != "error"}.values())
    if todo:
        texts = tokenizer.decode_batch([o.token_ids for o in todo], skip_special_tokens=skip_special_tokens)
        for o, t in zip(todo, texts):
            o.text = t
    output, reason, error, ptok, otok = [], [], [], [], []
    for i in range(n):
        o = outs[i]
        if o is None:
            output.append(None); reason.append("error"); error.append(r.errors[i])  # noqa: E702
            ptok.append(0); otok.append(0)  # noqa: E702
        elif o.finish_reason == "error":
            output.append(None); reason.append("error"); error.append(o.error or "error")  # noqa: E702
            ptok.append(len(o.prompt_token_ids)); otok.append(0)  # noqa: E702
        else:
            output.append(o.text); reason.append(o.finish_reason); error.append(None)  # noqa: E702
            ptok.append(len(o.prompt_token_ids)); otok.append(len(o.token_ids))  # noqa: E702
    if spec.input.id_column:
        ids = prep.table.column(spec.input.id_column)
    else:
        ids = pa.array(range(prep.unit.first_row, prep.unit.first_row + n), pa.int64())
    if any(e is not None for e in error):       # an error row never carries a credential
        scrub = redactor()
        error = [None if e is None else scrub(e) for e in error]
    cols = {"id": ids, "output": pa.array(output, pa.string()), "finish_reason": pa.array(reason, pa.string()),
            "error": pa.array(error, pa.string()), "prompt_tokens": pa.array(ptok, pa.int32()),
            "output_tokens": pa.array(otok, pa.int32()), "shared": pa.array(shared, pa.bool_())}
    for c in spec.input.passthrough:
        cols[c] = prep.table.column(c)
    if spec.output.include_prompt:
        cols["prompt"] = pa.array(r.prompts, pa.string())
    stats = {"errors": reason.count("error"), "prompt_tokens": sum(ptok), "output_tokens": sum(otok),
             **shared_stats(shared, ptok, otok)}
    return pa.table(cols), stats
