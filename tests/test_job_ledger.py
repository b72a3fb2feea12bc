"""The checkpoint ledger on real files: markers after parts, crash leftovers cleaned, fingerprints."""
from __future__ import annotations

import os
import threading

import duckdb
import pyarrow as pa
import pytest

from batchrun.connectors import ParquetSink
from batchrun.connectors.sink import part_name
from batchrun.job.ledger import FingerprintMismatch, Ledger

FP = {"model": {"config_sha256": "abc"}, "sampling": {"max_tokens": 4}, "input": {"files": [["a", 1, "t"]]}}


def commit(ledger: Ledger, k: int, rows: int = 5):
    t = pa.table({"id": pa.array([f"{k}-{i}" for i in range(rows)])})
    c = ledger.sink.commit(k, t, {"batchrun.job": "j"})
    ledger.mark_done(k, {"unit": k, "rows": rows, "bytes": c.bytes})


def test_fresh_then_resume(tmp_path):
    led = Ledger(ParquetSink(str(tmp_path / "out")))
    assert led.open(FP, {"units_total": 3, "rows_total": 15}) == {}
    commit(led, 0)
    commit(led, 2)
    led2 = Ledger(ParquetSink(str(tmp_path / "out")))
    done = led2.open(FP, {"units_total": 3, "rows_total": 15})
    assert sorted(done) == [0, 2] and done[0]["rows"] == 5
    assert led2.read_manifest()["units_total"] == 3
    assert led2.committed_files() == [led2.sink.path(part_name(0)), led2.sink.path(part_name(2))]


def test_crash_leftovers_are_cleaned_on_resume(tmp_path):
    out = str(tmp_path / "out")
    led = Ledger(ParquetSink(out))
    led.open(FP, {})
    commit(led, 0)
    # a crash between the part's rename and its marker, and one mid-write
    led.sink.commit(1, pa.table({"id": pa.array(["1-0"])}), {})
    os.makedirs(os.path.join(out, "_batchrun", "tmp"), exist_ok=True)
    open(os.path.join(out, "_batchrun", "tmp", "part-000002.parquet.x"), "wb").write(b"PAR1 half")
    done = Ledger(ParquetSink(out)).open(FP, {})
    assert sorted(done) == [0]
    assert sorted(os.listdir(out)) == ["_batchrun", part_name(0)]          # the orphan part 1 is gone
    assert not os.path.exists(os.path.join(out, "_batchrun", "tmp"))
    assert duckdb.connect().execute(f"SELECT count(*) FROM read_parquet('{out}/*.parquet')").fetchone() == (5,)


def test_marker_whose_part_changed_is_redone(tmp_path):
    out = str(tmp_path / "out")
    led = Ledger(ParquetSink(out))
    led.open(FP, {})
    commit(led, 0)
    commit(led, 1)
    with open(os.path.join(out, part_name(1)), "ab") as f:
        f.write(b"garbage")
    os.remove(os.path.join(out, part_name(0)))
    assert Ledger(ParquetSink(out)).open(FP, {}) == {}
    assert not [n for n in os.listdir(out) if n.endswith(".parquet")]


def test_fingerprint_mismatch_names_components_and_restart_discards(tmp_path):
    out = str(tmp_path / "out")
    led = Ledger(ParquetSink(out))
    led.open(FP, {})
    commit(led, 0)
    other = {**FP, "sampling": {"max_tokens": 5}}
    with pytest.raises(FingerprintMismatch) as e:
        Ledger(ParquetSink(out)).open(other, {})
    msg = str(e.value)
    assert "sampling changed" in msg and "--restart" in msg and "1 unit(s)" in msg
    assert os.path.exists(os.path.join(out, part_name(0)))                 # refused: nothing touched
    assert Ledger(ParquetSink(out)).open(other, {}, restart=True) == {}
    assert not os.path.exists(os.path.join(out, part_name(0)))
    assert Ledger(ParquetSink(out)).read_manifest()["fingerprint"] == other


def test_concurrent_commits_of_different_units(tmp_path):
    led = Ledger(ParquetSink(str(tmp_path / "out")))
    led.open(FP, {})
    threads = [threading.Thread(target=lambda k=k: [commit(led, k + 8 * j) for j in range(4)]) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(led.done_markers(verify=True)) == list(range(32))
    out = str(tmp_path / "out")
    assert duckdb.connect().execute(
        f"SELECT count(*), count(DISTINCT id) FROM read_parquet('{out}/*.parquet')").fetchone() == (160, 160)


def test_progress_and_json_files_are_replaced_atomically(tmp_path):
    led = Ledger(ParquetSink(str(tmp_path / "out")))
    for i in range(50):
        led.write_progress({"i": i})
    assert led.read_progress() == {"i": 49}
    assert [n for n in os.listdir(tmp_path / "out" / "_batchrun") if n.endswith(".tmp")] == []
