"""Structured outputs in jobs: `sampling.structured_outputs` for the whole job, `input.structured_outputs_column`
for a per-row spec (a bad one is an error row naming the column; the job goes on), OpenAI Batch's
`response_format`, and a bad job-level spec as exit 2 naming the key. The tiny random-init model cannot
answer anything, so the specs used here are ones every completed answer must satisfy by construction
(a choice list, a bounded regex, an enum-only schema), checked with `re`, jsonschema and DuckDB."""
from __future__ import annotations

import json
import os
import re

import duckdb
import jsonschema
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchrun.job.plan import make_plan
from batchrun.job.run import JobRunner
from batchrun.job.spec import JobError, parse_job
from test_job_common import cli, job_dict, results, tiny_model, write_job  # noqa: F401

ENUM_SCHEMA = {"type": "object", "properties": {"label": {"enum": ["river", "stone"]},
                                                "n": {"enum": [1, 2, 3]}},
               "required": ["label", "n"], "additionalProperties": False}
WORDS = ["alpha", "beta gamma", "delta"]


def run(job: dict) -> dict:
    return JobRunner(make_plan(parse_job(job, "<t>", "/")), progress_bar=False).run()


def test_a_job_wide_choice_constrains_every_row(tmp_path, tiny_model):  # noqa: F811
    rows = [{"id": f"r{i}", "text": f"river stone {i}", "topic": "a"} for i in range(12)]
    pq.write_table(pa.Table.from_pylist(rows), str(tmp_path / "in.parquet"))
    out = str(tmp_path / "out")
    s = run(job_dict(tiny_model, str(tmp_path / "in.parquet"), out,
                     sampling={"max_tokens": 16, "structured_outputs": {"choice": WORDS}}))
    got = results(out)
    assert s["rows"] == 12 and len(got) == 12
    assert all(g[1] in WORDS and g[2] == "stop" for g in got), got


def test_per_row_specs_and_bad_ones_as_error_rows(tmp_path, tiny_model):  # noqa: F811
    specs = {
        "choice": {"choice": WORDS},
        "other-choice": {"choice": ["engine", "garden"]},       # same prompt as `choice`: never deduped with it
        "regex": {"regex": "[a-c]{3}-[0-9]{2}"},
        "schema": {"json": ENUM_SCHEMA},
        "free": None,
        "bad-regex": {"regex": "(?=x)y"},
        "empty-choice": {"choice": []},
        "bad-schema": {"json": {"type": "frobnicate"}},
    }
    rows = [{"id": k, "text": "river stone", "topic": "a",
             "so": None if v is None else json.dumps(v)} for k, v in specs.items()]
    rows.append({"id": "not-json", "text": "river stone", "topic": "a", "so": "{oops"})
    pq.write_table(pa.Table.from_pylist(rows), str(tmp_path / "in.parquet"))
    out = str(tmp_path / "out")
    job = job_dict(tiny_model, str(tmp_path / "in.parquet"), out, sampling={"max_tokens": 24})
    job["input"]["structured_outputs_column"] = "so"
    s = run(job)
    got = {g[0]: g for g in results(out)}       # id -> (id, output, finish_reason, error, ptok, otok)
    assert s["rows"] == len(rows) and s["error_rows"] == 4 and len(got) == len(rows)
    assert got["choice"][1] in WORDS and got["other-choice"][1] in ("engine", "garden")
    assert re.fullmatch("[a-c]{3}-[0-9]{2}", got["regex"][1])
    assert got["schema"][2] == "stop"                # an enum-only object closes within 64 tokens
    jsonschema.validate(json.loads(got["schema"][1]), ENUM_SCHEMA)
    assert all(got[k][2] == "stop" for k in ("choice", "other-choice", "regex", "schema"))
    assert got["free"][2] in ("length", "stop") and got["free"][3] is None
    for k, text in (("bad-regex", "structured_outputs.regex"), ("empty-choice", "structured_outputs.choice"),
                    ("bad-schema", "structured_outputs.json"), ("not-json", "not a JSON object")):
        assert got[k][2] == "error" and "input.structured_outputs_column 'so'" in got[k][3], got[k]
        assert text in got[k][3] and "\n" not in got[k][3]
    # DuckDB reads the parsed fields straight from the output
    label, n = duckdb.connect().execute(
        f"SELECT json_extract_string(output, '$.label'), json_extract(output, '$.n')::INT "
        f"FROM read_parquet('{out}/*.parquet') WHERE id = 'schema'").fetchone()
    assert (label, n) == (json.loads(got["schema"][1])["label"], json.loads(got["schema"][1])["n"])


def test_openai_batch_response_format(tmp_path, tiny_model):  # noqa: F811
    def req(cid, **body):
        return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                           "body": {"messages": [{"role": "user", "content": "river stone"}], **body}})
    lines = [req("schema", response_format={"type": "json_schema",
                                            "json_schema": {"name": "x", "schema": ENUM_SCHEMA, "strict": True}},
                 max_tokens=64),
             req("object", response_format={"type": "json_object"}, max_tokens=24),
             req("text", response_format={"type": "text"}),
             req("no-schema", response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
             req("xml", response_format={"type": "xml"})]
    (tmp_path / "batch.jsonl").write_text("\n".join(lines) + "\n")
    out = str(tmp_path / "out")
    job = job_dict(tiny_model, str(tmp_path / "batch.jsonl"), out, sampling={"max_tokens": 8, "temperature": 0.0})
    job["input"] = {"uri": str(tmp_path / "batch.jsonl"), "format": "openai_batch"}
    s = run(job)
    got = {g[0]: g for g in results(out)}
    assert s["rows"] == 5 and s["error_rows"] == 2
    assert got["schema"][2] == "stop"                # an enum-only object closes within 64 tokens
    jsonschema.validate(json.loads(got["schema"][1]), ENUM_SCHEMA)
    assert got["object"][1].startswith("{")          # a random model's object may not close in 24 tokens
    if got["object"][2] == "stop":
        assert isinstance(json.loads(got["object"][1]), dict)
    assert got["text"][3] is None
    assert "body.response_format.json_schema.schema" in got["no-schema"][3]
    assert "body.response_format=" in got["xml"][3]


@pytest.mark.parametrize("so, key", [({"regex": "(?=x)y"}, "structured_outputs.regex"),
                                     ({"choice": []}, "structured_outputs.choice"),
                                     ({"json": {"type": 3}}, "structured_outputs.json"),
                                     ({"jsn": {}}, "unknown key 'jsn'")])
def test_a_bad_job_level_spec_names_the_key(tmp_path, so, key):
    job = job_dict(str(tmp_path / "model"), str(tmp_path / "in.parquet"), str(tmp_path / "out"),
                   sampling={"structured_outputs": so})
    with pytest.raises(JobError) as e:
        parse_job(job, "job.yaml", "/")
    assert str(e.value).startswith("job.yaml: sampling: ") and key in str(e.value) and "\n" not in str(e.value)


def test_a_bad_job_level_spec_exits_2_before_touching_the_output(tmp_path, tiny_model):  # noqa: F811
    pq.write_table(pa.Table.from_pylist([{"id": "a", "text": "x", "topic": "a"}]), str(tmp_path / "in.parquet"))
    out = str(tmp_path / "out")
    path = write_job(str(tmp_path / "job.yaml"), job_dict(tiny_model, str(tmp_path / "in.parquet"), out,
                                                          sampling={"structured_outputs": {"choice": []}}))
    r = cli("submit", path)
    assert r.returncode == 2 and "structured_outputs.choice" in r.stderr and "Traceback" not in r.stderr
    assert not os.path.exists(out)


def test_dedupe_keys_tell_specs_apart():
    """Identical prompts under different specs are different work; the same spec written in another key
    order is the same."""
    from batchrun.job.dedupe import request_key
    from batchrun.outputs import SamplingParams
    ids = [1, 2, 3]
    a = SamplingParams(temperature=0.0, structured_outputs={"json": ENUM_SCHEMA})
    b = SamplingParams(temperature=0.0, structured_outputs={"json": dict(reversed(list(ENUM_SCHEMA.items())))})
    c = SamplingParams(temperature=0.0, structured_outputs={"choice": WORDS})
    plain = SamplingParams(temperature=0.0)
    assert request_key(ids, a) == request_key(ids, b)
    assert len({request_key(ids, a), request_key(ids, c), request_key(ids, plain)}) == 3
