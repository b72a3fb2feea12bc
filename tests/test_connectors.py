"""Sources and the sink on real files: units from metadata, exact row coverage, clear errors, and
atomic publication that DuckDB's glob never sees half-done."""
from __future__ import annotations

import json
import os

import duckdb
import fsspec
from fsspec.implementations.local import LocalFileSystem
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest

from batchrun.connectors import CsvSource, InputError, JsonlSource, ParquetSink, ParquetSource, open_source
from batchrun.connectors.sink import part_name


def make_table(n: int, start: int = 0) -> pa.Table:
    return pa.table({"id": pa.array(range(start, start + n), pa.int64()),
                     "text": pa.array([f"row {i} " + "x" * (i % 7) for i in range(start, start + n)])})


def write_parquets(d, sizes, row_group_size):
    os.makedirs(d, exist_ok=True)
    start = 0
    for i, n in enumerate(sizes):
        pq.write_table(make_table(n, start), os.path.join(d, f"f{i}.parquet"), row_group_size=row_group_size)
        start += n


def concat_units(src, units, columns=None) -> pa.Table:
    return pa.concat_tables([src.read(u, columns) for u in units])


def test_parquet_units_align_to_row_groups_and_cover_every_row(tmp_path):
    write_parquets(tmp_path, [95, 40, 130], row_group_size=20)
    src = ParquetSource(str(tmp_path))
    units = src.units(50)
    # oracle: the row groups of each file from pyarrow's own metadata
    for u in units:
        md = pq.ParquetFile(u.path).metadata
        starts = [sum(md.row_group(j).num_rows for j in range(g)) for g in range(md.num_row_groups + 1)]
        assert u.row_start == starts[u.row_groups[0]]
        assert u.row_start + u.num_rows == starts[u.row_groups[-1] + 1]   # whole groups only
        assert u.num_rows <= 50
    assert [u.index for u in units] == list(range(len(units)))
    full = pa.concat_tables([pq.read_table(os.path.join(tmp_path, f"f{i}.parquet")) for i in range(3)])
    assert concat_units(src, units).equals(full)
    assert [u.first_row for u in units] == [sum(x.num_rows for x in units[:i]) for i in range(len(units))]
    assert src.num_rows == 265
    assert ParquetSource(str(tmp_path)).units(50) == units   # deterministic


def test_parquet_large_row_group_is_split_into_ranges(tmp_path):
    pq.write_table(make_table(1000), tmp_path / "big.parquet", row_group_size=1000)
    src = ParquetSource(str(tmp_path / "big.parquet"))
    units = src.units(128)
    assert [u.num_rows for u in units] == [128] * 7 + [104]
    assert all(u.row_groups == (0,) for u in units)
    assert concat_units(src, units, ["id"]).column("id").to_pylist() == list(range(1000))
    # out-of-order reads are fine too
    assert src.read(units[3], ["id"]).column("id").to_pylist() == list(range(384, 512))


class CountingFS(LocalFileSystem):
    """Local filesystem that counts bytes read, to show planning touches footers only."""
    read_bytes = 0

    def _open(self, path, mode="rb", **kw):
        f = super()._open(path, mode, **kw)
        orig = f.read

        def read(*a):
            data = orig(*a)
            CountingFS.read_bytes += len(data)
            return data
        f.read = read
        return f


def test_parquet_planning_reads_only_footers(tmp_path, monkeypatch):
    rng_text = [os.urandom(200).hex() for _ in range(20000)]   # ~8 MB of incompressible text
    pq.write_table(pa.table({"text": rng_text}), tmp_path / "a.parquet", row_group_size=1000)
    size = os.path.getsize(tmp_path / "a.parquet")
    import batchrun.connectors.base as base
    fs = CountingFS(skip_instance_cache=True)
    monkeypatch.setattr(base, "filesystem", lambda uri, so=None: (fs, uri))
    CountingFS.read_bytes = 0
    units = ParquetSource(str(tmp_path / "a.parquet")).units(2048)
    assert [u.num_rows for u in units] == [2000] * 10   # two 1000-row groups per unit
    assert 0 < CountingFS.read_bytes < size / 50, (CountingFS.read_bytes, size)


def test_jsonl_units_and_byte_offsets(tmp_path):
    rows = [{"id": i, "text": f"line {i}\nwith newline", "meta": {"k": i}} for i in range(37)]
    p = tmp_path / "a.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows[:20]) + "\n\n" + "\n".join(json.dumps(r) for r in rows[20:]))
    src = JsonlSource(str(p))
    units = src.units(10)
    assert [u.num_rows for u in units] == [10, 10, 10, 7]
    assert concat_units(src, units, ["id", "text"]).to_pylist() == [{"id": r["id"], "text": r["text"]} for r in rows]
    assert src.read(units[2], ["id"]).column("id").to_pylist() == list(range(20, 30))  # past the blank line


def test_csv_units_with_quoted_newlines_match_pyarrow(tmp_path):
    lines = ["id,text,score"] + [f'{i},"row {i}\nsecond line, with comma",{i * 0.5}' for i in range(55)]
    p = tmp_path / "a.csv"
    p.write_text("\n".join(lines) + "\n")
    src = CsvSource(str(p))
    units = src.units(20)
    assert [u.num_rows for u in units] == [20, 20, 15]
    oracle = pcsv.read_csv(p, parse_options=pcsv.ParseOptions(newlines_in_values=True))
    assert concat_units(src, units).equals(oracle)
    assert src.read(units[0], ["id"]).column("id").to_pylist() == list(range(20))   # seek back


def test_open_source_infers_format(tmp_path):
    pq.write_table(make_table(3), tmp_path / "a.parquet")
    (tmp_path / "b.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "c.csv").write_text("text\nx\n")
    assert isinstance(open_source(str(tmp_path / "a.parquet")), ParquetSource)
    assert isinstance(open_source(str(tmp_path / "b.jsonl")), JsonlSource)
    assert isinstance(open_source(str(tmp_path / "c.csv")), CsvSource)
    assert isinstance(open_source(str(tmp_path / "*.csv")), CsvSource)
    with pytest.raises(InputError, match="input.format 'xml'"):
        open_source(str(tmp_path / "a.parquet"), "xml")


def test_nonexistent_path_and_empty_glob(tmp_path):
    with pytest.raises(InputError, match=r"nope\.parquet: no such file or directory"):
        ParquetSource(str(tmp_path / "nope.parquet"))
    with pytest.raises(InputError, match="matches no input files"):
        ParquetSource(str(tmp_path / "*.parquet"))


def test_not_parquet_and_truncated_parquet_name_the_file(tmp_path):
    (tmp_path / "text.parquet").write_text("this is not parquet\n" * 10)
    with pytest.raises(InputError, match=r"text\.parquet: not a readable Parquet file"):
        ParquetSource(str(tmp_path / "text.parquet"))
    pq.write_table(make_table(100), tmp_path / "good.parquet")
    data = (tmp_path / "good.parquet").read_bytes()
    (tmp_path / "cut.parquet").write_bytes(data[: len(data) // 2])
    with pytest.raises(InputError, match=r"cut\.parquet: not a readable Parquet file"):
        ParquetSource(str(tmp_path / "cut.parquet"))


def test_mixed_parquet_schemas_name_file_and_column(tmp_path):
    pq.write_table(make_table(5), tmp_path / "a.parquet")
    pq.write_table(pa.table({"id": pa.array(["x"]), "text": pa.array(["t"])}), tmp_path / "b.parquet")
    with pytest.raises(InputError, match=r"b\.parquet: schema differs .*a\.parquet.*column 'id' is string"):
        ParquetSource(str(tmp_path))
    pq.write_table(pa.table({"id": pa.array([1])}), tmp_path / "b.parquet")
    with pytest.raises(InputError, match=r"b\.parquet: schema differs .*column 'text' missing"):
        ParquetSource(str(tmp_path))


def test_jsonl_errors(tmp_path):
    (tmp_path / "a.jsonl").write_text('not json\n{"text": "x"}\n')   # a bad line is an error row, not a stop
    src = JsonlSource(str(tmp_path / "a.jsonl"))
    t = src.read(src.units(10)[0])
    assert t.column("text").to_pylist() == [None, "x"]
    assert "a.jsonl: line 1: not valid JSON" in t.column("_batchrun_row_error")[0].as_py()
    (tmp_path / "a.jsonl").write_text('not json\n')          # no object at all: not a JSONL file
    with pytest.raises(InputError, match=r"a\.jsonl: line 1: not valid JSON"):
        JsonlSource(str(tmp_path / "a.jsonl"))
    (tmp_path / "a.jsonl").write_text('[1, 2]\n')
    with pytest.raises(InputError, match="a JSON object per line"):
        JsonlSource(str(tmp_path / "a.jsonl"))
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "b.jsonl").write_text('{"prompt": "x"}\n')
    with pytest.raises(InputError, match=r"b\.jsonl: columns \['prompt'\] differ"):
        JsonlSource(str(tmp_path))


def test_hidden_and_underscore_files_are_skipped_in_directories(tmp_path):
    write_parquets(tmp_path, [10], 5)
    os.makedirs(tmp_path / "_batchrun")
    pq.write_table(make_table(3), tmp_path / "_batchrun" / "x.parquet")
    pq.write_table(make_table(3), tmp_path / ".hidden.parquet")
    assert [os.path.basename(f.path) for f in ParquetSource(str(tmp_path)).listing.files] == ["f0.parquet"]


def test_memory_filesystem_source_and_sink():
    fs = fsspec.filesystem("memory")
    for i in range(2):
        with fs.open(f"/conn-test/in/p{i}.parquet", "wb") as f:
            pq.write_table(make_table(30, 30 * i), f, row_group_size=10)
    src = open_source("memory://conn-test/in/*.parquet")
    units = src.units(20)
    assert concat_units(src, units).column("id").to_pylist() == list(range(60))
    assert all(f.version for f in src.listing.files)
    sink = ParquetSink("memory://conn-test/out")
    c = sink.commit(0, make_table(4), {"batchrun.job": "x"})
    with fs.open(c.path, "rb") as f:
        t = pq.read_table(f)
    assert t.equals(make_table(4).replace_schema_metadata(t.schema.metadata))
    assert t.schema.metadata[b"batchrun.job"] == b"x"
    assert sink.list_parts() == {part_name(0): c.bytes}
    fs.rm("/conn-test", recursive=True)


def test_sink_publication_is_atomic_for_duckdb(tmp_path):
    out = str(tmp_path / "out")
    sink = ParquetSink(out)
    sink.commit(0, make_table(10), {"batchrun.job": "j", "batchrun.sampling": {"max_tokens": 4}})
    seen = []

    def during():   # bytes written in full under the temporary name, not yet renamed
        seen.append(duckdb.connect().execute(f"SELECT count(*) FROM read_parquet('{out}/*.parquet')").fetchone()[0])
        tmp = os.listdir(os.path.join(out, "_batchrun", "tmp"))
        seen.append(len(tmp))
    sink.commit(1, make_table(25, 10), {"batchrun.job": "j"}, before_publish=during)
    assert seen == [10, 1]
    con = duckdb.connect()
    assert con.execute(f"SELECT count(*), count(DISTINCT id) FROM read_parquet('{out}/*.parquet')").fetchone() == (35, 35)
    pf = pq.ParquetFile(os.path.join(out, part_name(0)))
    assert pf.metadata.row_group(0).column(0).compression == "ZSTD"
    meta = pf.schema_arrow.metadata
    assert json.loads(meta[b"batchrun.sampling"]) == {"max_tokens": 4}
    sink.clean_tmp()
    assert not os.path.exists(os.path.join(out, "_batchrun", "tmp"))
