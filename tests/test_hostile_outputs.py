"""Hostile output locations and permissions, an output left by a failed job, and the unexpected error's
log file. Permission cases run as real processes that obey file permissions as a non-root user does
(hostile_util.as_user); the rest in-process through the real CLI."""
from __future__ import annotations

import json
import os
import re
import shutil

import pytest

from hostile_util import as_user, committed, fails, invoke, job, rows, run, succeeds
from test_job_common import tiny_model, write_prompt_files  # noqa: F401 - fixture


@pytest.fixture
def d(tmp_path):
    write_prompt_files(str(tmp_path / "in"), 12, files=1, row_group_size=6)
    return tmp_path


@pytest.fixture
def locked(d):
    """d/locked: a directory its owner may read but not write (mode 0555); restored afterwards."""
    p = d / "locked"
    p.mkdir()
    p.chmod(0o555)
    yield p
    p.chmod(0o755)


def test_output_is_an_existing_file(d, tiny_model):  # noqa: F811
    """Reported: makedirs' FileExistsError was a traceback."""
    (d / "out").write_text("not a directory")
    fails(invoke("submit", job(d, tiny_model, "in"), "--no-progress"), 2, "output.uri", str(d / "out"), "is a file")
    assert (d / "out").read_text() == "not a directory"


def test_output_below_a_file(d, tiny_model):  # noqa: F811
    (d / "out").write_text("not a directory")
    fails(invoke("submit", job(d, tiny_model, "in", out="out/run1"), "--no-progress"), 2, "output.uri", "is a file")


def test_output_directory_not_writable(d, tiny_model, locked):  # noqa: F811
    """Reported: run as a non-root user, an output directory it cannot write was a traceback."""
    r = run("submit", job(d, tiny_model, "in", out=str(locked)), "--no-progress", preexec=as_user())
    fails(r, 74, str(locked), "Permission denied")
    assert os.listdir(locked) == []


def test_output_parent_not_writable(d, tiny_model, locked):  # noqa: F811
    r = run("submit", job(d, tiny_model, "in", out=str(locked / "a" / "b")), "--no-progress", preexec=as_user())
    fails(r, 74, str(locked / "a"), "Permission denied")


def test_unreadable_job_and_input_files(d, tiny_model):  # noqa: F811
    preexec = as_user()
    secret = job(d, tiny_model, "in", name="secret.yaml")
    os.chmod(secret, 0)
    fails(run("validate", secret, preexec=preexec), 2, "secret.yaml", "cannot read the job file")
    data = d / "in" / "prompts-00.parquet"
    data.chmod(0)
    fails(run("validate", job(d, tiny_model, "in"), preexec=preexec), 74, str(data), "Permission denied")


def test_a_job_failing_before_any_commit_does_not_claim_the_output(d, tiny_model):  # noqa: F811
    """Reported: a typo found at engine start left its manifest, and the corrected job (another
    fingerprint) was refused with exit 4. Here the typo is in config.json, found when weights load."""
    model = shutil.copytree(tiny_model, str(d / "m"))
    cfg_path = os.path.join(model, "config.json")
    with open(cfg_path) as f:
        good_cfg = f.read()
    cfg = json.loads(good_cfg)
    cfg["intermediate_size"] = 2 * cfg["intermediate_size"]
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    jf = job(d, model, "in")
    fails(invoke("submit", jf, "--no-progress"), 3, "tensor 'model.layers.0.mlp.", "config.json")
    assert (d / "out" / "_batchrun" / "manifest.json").exists() and committed(str(d / "out")) == 0
    with open(cfg_path, "w") as f:
        f.write(good_cfg)
    succeeds(invoke("submit", jf, "--no-progress"))
    got = rows(str(d / "out"))
    assert len(got) == 12 and len({g[0] for g in got}) == 12
    # once something is committed the manifest binds: a different job is refused and nothing is touched
    other = job(d, model, "in", name="other.yaml", sampling={"max_tokens": 3})
    fails(invoke("submit", other, "--no-progress"), 4, "holds results of a different job", "--restart")
    assert rows(str(d / "out")) == got


def test_unexpected_error_is_one_line_and_a_log_in_the_output(d, tiny_model):  # noqa: F811
    """An output whose manifest is a directory is nothing batchrun foresees: exit 1, one line ending in
    the log file's path (under the output's _batchrun/), and the traceback only there."""
    jf = job(d, tiny_model, "in")
    (d / "out" / "_batchrun" / "manifest.json").mkdir(parents=True)
    line = fails(run("submit", jf, "--no-progress"), 1, "unexpected error", "IsADirectoryError")
    log = re.search(r"\(traceback in (\S+)\)$", line).group(1)
    assert os.path.dirname(log) == str(d / "out" / "_batchrun")
    with open(log) as f:
        text = f.read()
    assert text.startswith("Traceback") and "IsADirectoryError" in text
