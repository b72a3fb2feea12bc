"""Hostile local inputs in every format: each ends in exit 3 with one line naming the file, column or line,
or in an error row naming the line while every other row is computed, and a failed run loses nothing
it committed. Through the real CLI, in-process; outputs read back with DuckDB."""
from __future__ import annotations

import json
import os
import signal

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchrun.connectors import CsvSource
from batchrun.job.hooks import CRASH_ENV
from hostile_util import committed, fails, invoke, job, rows, run, succeeds
from test_job_common import tiny_model  # noqa: F401 - fixture

WORDS = "river stone cloud paper engine garden window music table light".split()


def text(i: int) -> str:
    return " ".join(WORDS[(i * 3 + k) % len(WORDS)] for k in range(2 + i % 5))


def parquet(path, n: int, row_group_size: int = 10, text_type=pa.string(), texts=None) -> str:
    texts = texts if texts is not None else [text(i) for i in range(n)]
    if pa.types.is_binary(text_type):
        texts = [t if isinstance(t, bytes) else t.encode() for t in texts]
    pq.write_table(pa.table({"id": list(range(n)), "text": pa.array(texts, text_type)}), str(path),
                   row_group_size=row_group_size, compression="none", use_dictionary=False)
    return str(path)


def lines(path, body: bytes) -> str:
    with open(path, "wb") as f:
        f.write(body)
    return str(path)


@pytest.fixture
def d(tmp_path):
    (tmp_path / "in").mkdir()
    return tmp_path


def submit(d, model, uri, **sections):
    sections.setdefault("input", {}).setdefault("passthrough", [])
    return invoke("submit", job(d, model, uri, **sections), "--no-progress")


# -- where the input is ----------------------------------------------------------------------------------
def test_missing_input_path(d, tiny_model):  # noqa: F811
    fails(invoke("validate", job(d, tiny_model, "in/nope.parquet")), 3, "in/nope.parquet", "no such file")


def test_directory_without_input_files(d, tiny_model):  # noqa: F811
    (d / "in" / "notes.txt").write_text("hello")
    fails(invoke("validate", job(d, tiny_model, "in")), 3, str(d / "in"), "matches no input files")


# -- Parquet ---------------------------------------------------------------------------------------------
def test_jsonl_bytes_named_parquet(d, tiny_model):  # noqa: F811
    lines(d / "in" / "p.parquet", b'{"id": 1, "text": "hi"}\n')
    fails(invoke("validate", job(d, tiny_model, "in")), 3, "p.parquet", "not a readable Parquet file")


def test_truncated_parquet(d, tiny_model):  # noqa: F811
    path = parquet(d / "in" / "p.parquet", 40)
    data = open(path, "rb").read()
    lines(path, data[:len(data) - 30])           # the footer cut short
    fails(invoke("validate", job(d, tiny_model, "in")), 3, "p.parquet", "not a readable Parquet file")


def test_corrupt_page_is_exit_3_and_keeps_what_was_committed(d, tiny_model):  # noqa: F811
    """Reported: a corrupt page behind an intact footer was exit 74, as if the store had failed. Here the
    page rots (same size, same mtime) after an attempt committed two units and was killed."""
    path = parquet(d / "in" / "p.parquet", 40)
    jf = job(d, tiny_model, "in", input={"passthrough": []}, plan={"unit_rows": 10, "window_units": 1})
    assert run("submit", jf, "--no-progress", env={CRASH_ENV: "after_done:2"}).code == -signal.SIGKILL
    out = str(d / "out")
    before = rows(out)
    done = {json.loads((d / "out" / "_batchrun" / "done" / n).read_text())["input"]["row_start"] // 10
            for n in os.listdir(d / "out" / "_batchrun" / "done")}
    group = min(set(range(4)) - done)       # a unit still to do: its page goes bad
    chunk = pq.read_metadata(path).row_group(group).column(1)
    st = os.stat(path)
    data = bytearray(open(path, "rb").read())
    data[chunk.data_page_offset:chunk.data_page_offset + 24] = b"\xab" * 24    # page header garbage
    lines(path, bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    fails(invoke("submit", jf, "--no-progress"), 3, "p.parquet", f"row group(s) {group}", "corrupt")
    assert len(done) == 2 and len(before) == 20 and rows(out) == before


def test_mixed_schemas_name_both_files(d, tiny_model):  # noqa: F811
    parquet(d / "in" / "a.parquet", 10)
    parquet(d / "in" / "b.parquet", 10, text_type=pa.int64(), texts=list(range(10)))
    fails(invoke("validate", job(d, tiny_model, "in")), 3, "b.parquet", "a.parquet", "column 'text'")


def test_missing_column_suggests_the_near_one(d, tiny_model):  # noqa: F811
    parquet(d / "in" / "p.parquet", 10)
    fails(invoke("validate", job(d, tiny_model, "in", input={"prompt_column": "txt"})), 3,
          "input.prompt_column", "'txt'", "did you mean 'text'?")


def test_binary_column_advice_then_template_decodes_it(d, tiny_model):  # noqa: F811
    """Reported: following the advice ("{text}") used to put the bytes' repr b'...' in every prompt."""
    texts = [text(i).encode() for i in range(11)] + [b"caf\xe9 latin-1"]
    parquet(d / "in" / "p.parquet", 12, text_type=pa.binary(), texts=texts)
    fails(submit(d, tiny_model, "in"), 3, "column 'text'", "is binary", '"{text}"')
    r = submit(d, tiny_model, "in", input={"prompt_column": None, "prompt_template": "{text}"},
               output={"include_prompt": True})
    succeeds(r)
    got = duckdb.connect().execute(f"SELECT id, prompt, finish_reason, error FROM read_parquet('{d}/out/*.parquet') "
                                   "ORDER BY id").fetchall()
    assert [g[1] for g in got[:11]] == [t.decode() for t in texts[:11]]
    assert got[11][1] is None and got[11][2] == "error" and "column 'text'" in got[11][3] and "UTF-8" in got[11][3]


def test_empty_parquet_is_an_empty_job(d, tiny_model):  # noqa: F811
    parquet(d / "in" / "p.parquet", 0)
    succeeds(submit(d, tiny_model, "in"))
    assert (d / "out" / "_SUCCESS").exists() and committed(str(d / "out")) == 0


# -- JSONL -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad_line", [2, 70])
def test_integer_beyond_64_bits_is_an_error_row(d, tiny_model, bad_line):  # noqa: F811
    """Reported: an id beyond int64 on line 2 (in the typing sample) or 70 (after it) was a traceback."""
    objs = [json.dumps({"id": i, "text": text(i)}) for i in range(1, 72)]
    objs[bad_line - 1] = '{"id": 123456789012345678901234567890, "text": "x"}'
    path = lines(d / "in" / "p.jsonl", ("\n".join(objs) + "\n").encode())
    succeeds(submit(d, tiny_model, "in/p.jsonl", plan={"unit_rows": 40}))
    got = rows(str(d / "out"))
    assert len(got) == 71 and [g[0] for g in got[:70]] == [i for i in range(1, 72) if i != bad_line]
    assert got[70][:2] == (None, "error")
    assert got[70][2].startswith(f"{path}: line {bad_line}: 'id': integer 123456789012345678901234567890")


def test_jsonl_without_an_object(d, tiny_model):  # noqa: F811
    lines(d / "in" / "p.jsonl", b"[1, 2]\n\"text\"\n")
    fails(invoke("validate", job(d, tiny_model, "in/p.jsonl")), 3, "p.jsonl: line 1", "JSON object")


def test_empty_jsonl(d, tiny_model):  # noqa: F811
    lines(d / "in" / "p.jsonl", b"\n\n")
    fails(invoke("validate", job(d, tiny_model, "in/p.jsonl")), 3, "p.jsonl", "no JSON lines")


# -- CSV -------------------------------------------------------------------------------------------------
def test_one_latin1_row_is_an_error_row(d, tiny_model):  # noqa: F811
    """Reported: one Latin-1 row made the whole column binary and the job exit 3."""
    body = "id,text\n" + "".join(f"{i},{text(i)}\n" for i in range(5))
    body = body.encode() + b"5,caf\xe9 au lait\n" + "".join(f"{i},{text(i)}\n" for i in range(6, 9)).encode()
    path = lines(d / "in" / "p.csv", body)
    succeeds(submit(d, tiny_model, "in/p.csv", output={"include_prompt": True}))
    got = duckdb.connect().execute(f"SELECT id, prompt, error FROM read_parquet('{d}/out/*.parquet') "
                                   "ORDER BY id NULLS LAST").fetchall()
    assert [(g[0], g[1]) for g in got[:8]] == [(i, text(i)) for i in range(9) if i != 5]
    assert got[8][0] is None and got[8][2].startswith(f"{path}: line 7: column 'text' is not UTF-8")


def test_latin1_row_past_the_typing_block(d):
    """Types come from the first MiB; a Latin-1 value far after it is still one error row, in its unit."""
    n = 30_000
    body = ("id,text\n" + "".join(f"{i},{text(i)} {'x' * 30}\n" for i in range(n))).encode()
    path = lines(d / "in" / "p.csv", body + f"{n},".encode() + b"\xff\xfe\n")
    src = CsvSource(path)
    assert len(body) > 1 << 20 and str(src.schema.field("text").type) == "string"
    last = src.units(10_000)[-1]
    t = src.read(last, ["id", "text"])
    err = t.column("_batchrun_row_error").to_pylist()
    assert t.num_rows == last.num_rows and err[-1].startswith(f"{path}: line {n + 2}: column 'text'")
    assert all(e is None for e in err[:-1]) and t.column("id").to_pylist()[-1] is None


def test_header_only_csv_is_an_empty_job(d, tiny_model):  # noqa: F811
    lines(d / "in" / "p.csv", b"id,text\n")
    succeeds(submit(d, tiny_model, "in/p.csv"))
    assert (d / "out" / "_SUCCESS").exists()
