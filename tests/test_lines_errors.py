"""Bad lines in JSONL and CSV inputs become error rows naming the file and the line; the job goes on.

Real files with invalid JSON, non-object lines, a value of the wrong type, non-UTF-8 bytes, CSV rows
with too many or too few fields (after quoted values spanning lines and a blank line). The oracle for
positions and line numbers is the list the test writes; the oracle for the good rows' outputs is the
same job over a file holding only the good rows.
"""
from __future__ import annotations

import json
import os

import pyarrow as pa
import pytest

from batchrun.connectors import ROW_ERROR, CsvSource, JsonlSource
from batchrun.job.plan import make_plan
from batchrun.job.run import JobRunner
from batchrun.job.spec import parse_job
from test_job_common import job_dict, results, tiny_model  # noqa: F401

WORDS = "river stone cloud paper engine garden window music table light".split()


def text(i: int) -> str:
    return " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(1 + i % 6))


def write_jsonl(path: str) -> tuple[list, list]:
    """A JSONL file with good and bad lines. Returns (expected rows, good rows): an expected row is
    ("ok", id) or ("bad", line number, fragment of the error)."""
    chunks: list[bytes] = []
    expected, good = [], []
    bad = {3: (b"not json at all", "not valid JSON"), 6: (b"[1, 2, 3]", "a JSON object per line is required"),
           9: (b'{"id": "nine", "text": "x"}', "column 'id' is string"),
           12: (b'{"id": 12, "text": "\xff\xfe broken"}', "not UTF-8"), 15: (b'"just a string"', "found str"),
           16: (b'{"id": 16, "text": "unterminated', "not valid JSON")}
    line = 0
    for i in range(24):
        if i == 8:
            chunks.append(b"\n")            # a blank line: not a row, but it counts for line numbers
            line += 1
        line += 1
        if i in bad:
            raw, frag = bad[i]
            chunks.append(raw + b"\n")
            expected.append(("bad", line, frag))
        else:
            obj = {"id": i, "text": text(i)}
            chunks.append(json.dumps(obj).encode() + b"\n")
            expected.append(("ok", i))
            good.append(obj)
    with open(path, "wb") as f:
        f.write(b"".join(chunks))
    return expected, good


def write_csv(path: str) -> tuple[list, list]:
    """A CSV file with rows of the wrong width after quoted multi-line values and a blank line."""
    lines = ["id,text"]
    expected, good = [], []
    bad = {2: "2,too,many,fields", 7: "7", 11: '11,"quoted, but",extra', 19: "19,a,b"}
    for i in range(20):
        if i == 5:
            lines.append("")                   # blank line: skipped by the reader, counted by editors
        if i in bad:
            lines.append(bad[i])     # its physical line: every earlier entry's lines, plus one
            expected.append(("bad", sum(x.count("\n") + 1 for x in lines[:-1]) + 1, "fields"))
        elif i % 4 == 1:
            t = text(i) + "\nsecond line, with a comma"   # a value spanning two lines
            lines.append(f'{i},"{t}"')
            expected.append(("ok", i))
            good.append({"id": i, "text": t})
        else:
            lines.append(f"{i},{text(i)}")
            expected.append(("ok", i))
            good.append({"id": i, "text": text(i)})
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return expected, good


def check_table(t: pa.Table, expected: list, path: str) -> None:
    errors = t.column(ROW_ERROR).to_pylist() if ROW_ERROR in t.column_names else [None] * t.num_rows
    ids = t.column("id").to_pylist()
    assert len(ids) == len(expected)
    for got_id, err, exp in zip(ids, errors, expected):
        if exp[0] == "ok":
            assert (got_id, err) == (exp[1], None)
        else:
            assert got_id is None
            assert err.startswith(f"{path}: line {exp[1]}: "), err
            assert exp[2] in err, err


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
@pytest.mark.parametrize("unit_rows", [1, 4, 100])
def test_bad_lines_keep_their_place_and_name_their_line(tmp_path, fmt, unit_rows):
    path = str(tmp_path / f"in.{fmt}")
    expected, _ = (write_jsonl if fmt == "jsonl" else write_csv)(path)
    src = (JsonlSource if fmt == "jsonl" else CsvSource)(path)
    units = src.units(unit_rows)
    assert sum(u.num_rows for u in units) == len(expected)
    tables = [src.read(u, ["id", "text"]) for u in units]
    got = pa.concat_tables([t.select(["id"]).append_column(
        ROW_ERROR, t.column(ROW_ERROR) if ROW_ERROR in t.column_names else pa.nulls(t.num_rows, pa.string()))
        for t in tables])
    check_table(got, expected, path)
    if unit_rows == 4:    # units read out of order (a resume) give the same rows
        again = pa.concat_tables([src.read(u, ["id"]).select(["id"]) for u in reversed(units)])
        assert sorted(again.column("id").to_pylist(), key=str) == sorted(got.column("id").to_pylist(), key=str)


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_job_over_bad_lines_every_row_once_and_good_rows_as_a_clean_run(tmp_path, tiny_model, fmt):  # noqa: F811
    path = str(tmp_path / f"in.{fmt}")
    expected, good = (write_jsonl if fmt == "jsonl" else write_csv)(path)
    clean = str(tmp_path / "clean.jsonl")
    with open(clean, "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in good))

    def run(uri: str, out: str):
        job = job_dict(tiny_model, uri, out, input={"passthrough": []}, plan={"unit_rows": 5, "window_units": 2})
        return JobRunner(make_plan(parse_job(job, "<t>", "/")), progress_bar=False).run()

    summary = run(path, str(tmp_path / "out"))
    n_bad = sum(1 for e in expected if e[0] == "bad")
    assert summary["rows"] == len(expected) and summary["error_rows"] == n_bad
    got = results(str(tmp_path / "out"))          # (id, output, finish_reason, error, ptok, otok)
    ok = [g for g in got if g[0] is not None]
    assert sorted(g[0] for g in ok) == sorted(e[1] for e in expected if e[0] == "ok")   # each good id once
    errs = [g for g in got if g[0] is None]
    assert len(errs) == n_bad and all(g[2] == "error" and g[1] is None for g in errs)
    for e in expected:
        if e[0] == "bad":     # each bad line is named by exactly one error row
            assert sum(1 for g in errs if g[3].startswith(f"{path}: line {e[1]}: ")) == 1
    run(clean, str(tmp_path / "ref"))
    assert ok == results(str(tmp_path / "ref"))


def test_a_file_without_any_object_is_an_input_error(tmp_path):
    from batchrun.connectors import InputError
    p = tmp_path / "a.jsonl"
    p.write_text("[1]\n[2]\n")
    with pytest.raises(InputError, match=r"a\.jsonl: line 1: a JSON object per line is required"):
        JsonlSource(str(p))
    assert os.path.exists(p)
