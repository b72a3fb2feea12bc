"""Hostile job files and `--set` values: each is exit 2 and one stderr line naming the file and the key,
and nothing is written under the output. Run in-process through the real CLI (`validate` reads the job
exactly as `submit` does; a few go through `submit` itself)."""
from __future__ import annotations

import os

import pytest

from hostile_util import fails, invoke, job
from test_job_common import tiny_model, write_prompt_files  # noqa: F401 - fixture


@pytest.fixture
def d(tmp_path, tiny_model):  # noqa: F811
    write_prompt_files(str(tmp_path / "in"), 20, files=1, row_group_size=10)
    return tmp_path


def untouched(d) -> None:
    assert not (d / "out").exists(), os.listdir(d / "out")


def write(d, text, name="job.yaml", mode="w"):
    path = d / name
    with open(path, mode) as f:
        f.write(text)
    return str(path)


@pytest.mark.parametrize("command", ["validate", "submit"])
def test_missing_job_file(d, command):
    fails(invoke(command, str(d / "nope.yaml")), 2, "nope.yaml", "no such job file")


def test_job_file_that_is_a_directory(d):
    fails(invoke("submit", str(d / "in")), 2, str(d / "in"), "is a directory")


def test_empty_job_file_names_the_required_keys(d):
    fails(invoke("validate", write(d, "")), 2, "job.yaml", "name: required key missing", "model: required")


def test_invalid_yaml_names_line_and_column(d):
    line = fails(invoke("validate", write(d, "name: x\nmodel:\n  path: m\n   dtype: float32\n")), 2,
                 "job.yaml", "not valid YAML")
    assert "line 4, column" in line


def test_a_yaml_list_is_not_a_job(d):
    fails(invoke("validate", write(d, "- name: x\n- model: y\n")), 2, "job.yaml", "YAML mapping, found a list")


def test_a_yaml_list_with_set_is_not_a_traceback(d):
    """Reported: `--set` on a list used to walk it as a mapping and raise TypeError."""
    r = invoke("submit", write(d, "- 1\n- 2\n"), "--set", "engine.max_num_seqs=4")
    fails(r, 2, "job.yaml", "YAML mapping, found a list")


def test_job_file_not_utf8(d):
    fails(invoke("validate", write(d, b"name: caf\xe9\n", mode="wb")), 2, "job.yaml", "not UTF-8")


def test_python_tags_are_refused_not_run(d, tiny_model):  # noqa: F811
    text = "name: !!python/object/apply:os.system ['touch pwned']\n"
    fails(invoke("validate", write(d, text)), 2, "job.yaml", "not valid YAML")
    assert not os.path.exists(os.path.join(os.getcwd(), "pwned"))


def test_misspelt_nested_key(d, tiny_model):  # noqa: F811
    fails(invoke("validate", job(d, tiny_model, "in", plan={"unit_row": 5})), 2, "job.yaml",
          "plan.unit_row: unknown key, did you mean unit_rows?")
    untouched(d)


def test_wrong_type_names_the_key(d, tiny_model):  # noqa: F811
    fails(invoke("submit", job(d, tiny_model, "in", plan={"unit_rows": "many"})), 2, "plan.unit_rows")
    untouched(d)


def test_dtype_typo_fails_before_the_output_is_touched(d, tiny_model):  # noqa: F811
    fails(invoke("submit", job(d, tiny_model, "in", model={"path": tiny_model, "dtype": "bfloat61"}),
                 "--no-progress"), 2, "model.dtype", "bfloat61")
    untouched(d)


def test_max_model_len_beyond_the_model(d, tiny_model):  # noqa: F811
    fails(invoke("submit", job(d, tiny_model, "in", engine={"max_model_len": 99999}), "--no-progress"), 2,
          "engine.max_model_len", "99999", os.path.join(tiny_model, "config.json"))
    untouched(d)


def test_bad_speculative_config_names_the_key(d, tiny_model):  # noqa: F811
    spec = {"method": "ngram", "num_speculative_tokens": [1]}
    fails(invoke("submit", job(d, tiny_model, "in", engine={"speculative_config": spec})), 2,
          "engine.speculative_config")
    untouched(d)


@pytest.mark.parametrize("out", ["in", "in/results"])
def test_output_inside_the_input_is_refused(d, tiny_model, out):  # noqa: F811
    fails(invoke("submit", job(d, tiny_model, "in", out=out)), 2, "output.uri", "inside input.uri")
    assert sorted(os.listdir(d / "in")) == ["prompts-00.parquet"]


def test_underscore_output_inside_the_input_is_allowed(d, tiny_model):  # noqa: F811
    """The listing skips `_` folders, so `in/_out` can never be read back as input."""
    r = invoke("validate", job(d, tiny_model, "in", out="in/_out"))
    assert r.code == 0, r


# -- --set -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["[1", "{a: 1", "'open", "a: b: c"])
def test_set_value_not_yaml_names_the_key(d, tiny_model, value):  # noqa: F811
    """Reported: a --set value that is not YAML raised yaml's ScannerError/ParserError."""
    fails(invoke("submit", job(d, tiny_model, "in"), "--set", f"engine.max_num_seqs={value}"), 2,
          "--set engine.max_num_seqs", "not valid YAML")
    untouched(d)


@pytest.mark.parametrize("assignment, needle", [
    ("engine.max_num_seqs", "expected key.path=value"),
    ("name.first=x", "--set name.first: name is not a mapping"),
    ("engine..max_num_seqs=4", "an empty key name"),
    ("engine.max_num_seq=4", "did you mean max_num_seqs?"),
    ("engine.max_num_seqs=lots", "engine.max_num_seqs"),
    ("output.storage_options.secret=${BATCHRUN_TEST_HOSTILE_UNSET}", "environment variable BATCHRUN_TEST_HOSTILE_UNSET"),
])
def test_bad_set_assignments(d, tiny_model, assignment, needle):  # noqa: F811
    fails(invoke("submit", job(d, tiny_model, "in"), "--set", assignment), 2, needle)
    untouched(d)
