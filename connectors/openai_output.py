"""The OpenAI Batch API output file, written beside the Parquet results (`output.openai_jsonl: true`).

One line per result row, as the Batch API writes them, so code reading a Batch API output file reads
this one unchanged:
    {"id": "batch_req_…", "custom_id": "…", "response": {"status_code": 200, "request_id": "req_…",
     "body": {"id": "chatcmpl-…", "object": "chat.completion", "created": …, "model": "…",
              "choices": [{"index": 0, "message": {"role": "assistant", "content": "…"},
                           "logprobs": null | {"content": [{token, logprob, bytes, top_logprobs}]},
                           "finish_reason": "stop" | "length"}, ... one per sample (n)],
              "usage": {"prompt_tokens": …, "completion_tokens": …, "total_tokens": …},
              "system_fingerprint": "…"}},
     "error": null}
and for an error row `"response": null, "error": {"code": "invalid_request", "message": "…"}`.

The file is assembled at the end of the job from the committed part files, in unit order (like the
Batch API, consumers should match lines by custom_id), so it holds every row exactly once whatever
crashes and resumes came before; it is published atomically (local rename; one upload on object
stores). Ids are derived from the job fingerprint and the row's place, so a re-assembly is identical.
"""
from __future__ import annotations

import hashlib
import json
import os
import uuid
from typing import Any, Iterable, Optional

import pyarrow.parquet as pq

from batchrun.connectors.store import OutputStore

OPENAI_OUTPUT = "openai_output.jsonl"
COLUMNS = ["id", "output", "finish_reason", "error", "prompt_tokens", "output_tokens"]
OPTIONAL = ["sample_index", "logprobs", "top_logprobs"]     # parts written before n / logprobs lack them


def _hid(*parts: Any) -> str:
    return hashlib.sha256("\0".join(map(str, parts)).encode()).hexdigest()[:24]


def _token(t: dict) -> dict:
    text = t["token"] or ""
    return {"token": text, "logprob": t["logprob"], "bytes": list(text.encode("utf-8"))}


def _logprobs(r: dict) -> Optional[dict]:
    """OpenAI's choice.logprobs from a row's logprob columns (None when the row asked for none)."""
    if r.get("logprobs") is None:
        return None
    tops = r.get("top_logprobs") or [None] * len(r["logprobs"])
    return {"content": [{**_token(t), "top_logprobs": [_token(x) for x in (top or [])]}
                        for t, top in zip(r["logprobs"], tops)], "refusal": None}


def _requests(rows: Iterable[tuple[str, int, dict]]) -> Iterable[tuple[str, int, list[dict]]]:
    """(where, index, row) of consecutive result rows -> (where, index of the first, the rows) per request:
    a request's n samples are consecutive rows of one id, sample_index 0..n-1."""
    group: list = []
    for where, j, r in rows:
        if group and (r.get("sample_index") or 0) == 0:
            yield group[0][0], group[0][1], [g[2] for g in group]
            group = []
        group.append((where, j, r))
    if group:
        yield group[0][0], group[0][1], [g[2] for g in group]


def request_lines(rows: Iterable[tuple[str, int, dict]], created: int, model: str,
                  fingerprint: str) -> Iterable[str]:
    """One line per request from (where, index, row) triples: its samples' rows become `choices`."""
    for where, j, group in _requests(rows):
        h = _hid(fingerprint, where, j)
        r = group[0]
        cid = None if r["id"] is None else str(r["id"])
        if r["finish_reason"] == "error":
            line = {"id": f"batch_req_{h}", "custom_id": cid, "response": None,
                    "error": {"code": "invalid_request", "message": r["error"] or "error"}}
        else:
            p, c = int(r["prompt_tokens"] or 0), sum(int(x["output_tokens"] or 0) for x in group)
            choices = [{"index": int(x.get("sample_index") or 0),
                        "message": {"role": "assistant", "content": x["output"]},
                        "logprobs": _logprobs(x), "finish_reason": x["finish_reason"]} for x in group]
            body = {"id": f"chatcmpl-{h}", "object": "chat.completion", "created": created, "model": model,
                    "choices": choices,
                    "usage": {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c},
                    "system_fingerprint": f"batchrun-{fingerprint}"}
            line = {"id": f"batch_req_{h}", "custom_id": cid,
                    "response": {"status_code": 200, "request_id": f"req_{h}", "body": body}, "error": None}
        yield json.dumps(line, ensure_ascii=False)


def write_openai_output(sink: OutputStore, parts: list[tuple[str, float]], model: str, fingerprint: str,
                        name: str = OPENAI_OUTPUT) -> str:
    """Write `name` under the sink's root from `parts` [(path of a committed part file, commit time)],
    in that order; returns its URL. Streams part by part through a local temporary file."""
    tmp = os.path.join(sink.staging_dir(), f"{name}.{uuid.uuid4().hex}")
    try:
        with open(tmp, "w", encoding="utf-8") as out:
            for path, committed_at in parts:
                rel = path[len(sink.root) + 1:] if path.startswith(sink.root + "/") else path
                with sink.fs.open(path, "rb") as fh:
                    pf = pq.ParquetFile(fh)
                    cols = COLUMNS + [c for c in OPTIONAL if c in pf.schema_arrow.names]

                    def rows():
                        for g in range(pf.num_row_groups):
                            for j, r in enumerate(pf.read_row_group(g, columns=cols).to_pylist()):
                                yield f"{rel}#{g}", j, r
                    for text in request_lines(rows(), int(committed_at), model, fingerprint):
                        out.write(text + "\n")
            out.flush()
            os.fsync(out.fileno())
        sink.publish_file(name, tmp)      # readers see the old file or the whole new one
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return sink.url_of(name)


__all__ = ["OPENAI_OUTPUT", "request_lines", "write_openai_output"]
