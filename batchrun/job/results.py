"""What a run writes about its rows: the result table of one unit (one output row per input row, in input
order, and its done-marker stats), and the summary of a finished run."""
from __future__ import annotations

import resource
import time
from typing import Any, Optional

import pyarrow as pa

from batchrun.connectors.secrets import redactor
from batchrun.job.dedupe import dedupe_summary, shared_stats
from batchrun.job.plan import fingerprint_hash

# Engine counters copied into summary.json: batching, preemption (swap / recompute), prefix cache, speculation.
SUMMARY_ENGINE_STATS = ("steps", "tokens_per_step", "num_blocks", "peak_blocks_used", "preemptions",
                        "swapped_out_blocks", "swapped_in_blocks", "recomputed_tokens", "prefix_cache_queries",
                        "prefix_cache_hits", "prefix_cache_hit_rate", "spec_proposed", "spec_accepted",
                        "spec_acceptance_rate", "mean_tokens_per_decode_step", "host_overhead_ms_per_step",
                        "host_overhead_fraction")


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


def job_summary(runner) -> dict:
    """The summary of a finished run (`submit --json`'s last line, `_batchrun/summary.json`): totals over
    every committed unit (the done markers), this run's rates, the engine's counters, the dedupe saving."""
    markers = runner.ledger.done_markers()
    wall = time.time() - runner.t_start
    rows_run = runner._committed_rows
    st = runner.stats
    total = lambda key: sum(int(m.get(key, 0)) for m in markers.values())  # noqa: E731
    return {
        "ok": True, "job": runner.spec.name, "state": "finished", "output": runner.sink.url,
        "units": len(runner.plan.units), "units_committed": runner._committed_units,
        "units_skipped": runner.units_done_before,
        "rows": total("rows"), "error_rows": total("errors"), "prompt_tokens": total("prompt_tokens"),
        "output_tokens": total("output_tokens"),
        "rows_this_run": rows_run, "wall_s": round(wall, 3),
        "rows_per_s": round(rows_run / wall, 2) if wall > 0 else None,
        "output_tokens_per_s": round(runner._committed_out_tokens / wall, 2) if wall > 0 else None,
        "engine_loop_s": round(runner.loop_s, 3), "engine_step_s": round(runner.engine_s, 3),
        "engine_busy_fraction": round(runner.engine_s / runner.loop_s, 4) if runner.loop_s > 0 else None,
        "engine": {k: st[k] for k in SUMMARY_ENGINE_STATS if k in st},
        "memory_ledger": runner.memory_ledger,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "fingerprint": fingerprint_hash(runner.plan.fingerprint),
        "dedupe": dedupe_summary(markers, runner.spec.dedupe),
    }
