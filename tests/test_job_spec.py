"""The job file: strict keys with did-you-mean, --set overrides with YAML types, relative paths."""
from __future__ import annotations

import os

import pytest
import yaml

from batchrun.engine.config import EngineConfig
from batchrun.job.spec import JobError, load_job, parse_job
from batchrun.outputs import SamplingParams

BASE = {"name": "j", "model": {"path": "m"}, "input": {"uri": "in.parquet", "prompt_column": "text"},
        "output": {"uri": "out/"}}


def write(tmp_path, data) -> str:
    p = tmp_path / "job.yaml"
    p.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return str(p)


def test_minimal_job_defaults_and_relative_paths(tmp_path):
    spec = load_job(write(tmp_path, BASE))
    assert spec.model.path == os.path.join(str(tmp_path), "m")
    assert spec.input.uri == os.path.join(str(tmp_path), "in.parquet")
    assert spec.output.uri == os.path.join(str(tmp_path), "out")
    # defaults are SamplingParams' and EngineConfig's own, not a second copy that could drift
    assert spec.sampling_params() == SamplingParams()
    assert spec.engine.max_num_seqs == EngineConfig().max_num_seqs
    assert spec.plan.unit_rows == 2048 and spec.plan.order == "length"


def test_fsspec_urls_are_not_made_relative(tmp_path):
    spec = load_job(write(tmp_path, {**BASE, "input": {"uri": "memory://bucket/in/*.parquet",
                                                       "prompt_column": "t"}}))
    assert spec.input.uri == "memory://bucket/in/*.parquet"


@pytest.mark.parametrize("section,key,suggestion", [
    ("engine", "max_num_seq", "max_num_seqs"),
    ("sampling", "max_token", "max_tokens"),
    ("plan", "unit_row", "unit_rows"),
    ("input", "prompt_colum", "prompt_column"),
])
def test_unknown_key_names_its_path_and_suggests(tmp_path, section, key, suggestion):
    data = {**BASE, section: {**BASE.get(section, {}), key: 1}}
    with pytest.raises(JobError) as e:
        load_job(write(tmp_path, data))
    assert f"{section}.{key}: unknown key, did you mean {suggestion}?" in str(e.value)
    assert "job.yaml" in str(e.value)


def test_unknown_top_level_key(tmp_path):
    with pytest.raises(JobError, match=r"sampleing: unknown key, did you mean sampling\?"):
        load_job(write(tmp_path, {**BASE, "sampleing": {}}))


def test_missing_and_badly_typed_keys(tmp_path):
    with pytest.raises(JobError, match=r"output: required key missing"):
        load_job(write(tmp_path, {k: v for k, v in BASE.items() if k != "output"}))
    with pytest.raises(JobError, match=r"plan\.unit_rows"):
        load_job(write(tmp_path, {**BASE, "plan": {"unit_rows": 0}}))
    with pytest.raises(JobError, match=r"plan\.order"):
        load_job(write(tmp_path, {**BASE, "plan": {"order": "random"}}))
    with pytest.raises(JobError, match=r"engine\.max_num_seqs"):
        load_job(write(tmp_path, {**BASE, "engine": {"max_num_seqs": "many"}}))


def test_engine_and_sampling_checks_of_their_own_classes(tmp_path):
    with pytest.raises(JobError, match="block_size must be a power of two"):
        load_job(write(tmp_path, {**BASE, "engine": {"block_size": 12}}))
    with pytest.raises(JobError, match="top_p"):
        load_job(write(tmp_path, {**BASE, "sampling": {"top_p": 0}}))


def test_not_yaml_not_a_mapping_no_file(tmp_path):
    with pytest.raises(JobError, match="not valid YAML"):
        load_job(write(tmp_path, "name: [unclosed"))
    with pytest.raises(JobError, match="a job file is a YAML mapping"):
        load_job(write(tmp_path, "- a\n- b\n"))
    with pytest.raises(JobError, match="no such job file"):
        load_job(str(tmp_path / "nope.yaml"))


def test_prompt_source_rules(tmp_path):
    with pytest.raises(JobError, match="exactly one of prompt_column, messages_column"):
        load_job(write(tmp_path, {**BASE, "input": {"uri": "x"}}))
    with pytest.raises(JobError, match="messages_column cannot be combined"):
        load_job(write(tmp_path, {**BASE, "input": {"uri": "x", "prompt_column": "a", "messages_column": "m"}}))
    with pytest.raises(JobError, match="collide with the output's own columns"):
        load_job(write(tmp_path, {**BASE, "input": {**BASE["input"], "passthrough": ["output"]}}))
    with pytest.raises(JobError, match=r"placeholder \{\} must name a column"):
        load_job(write(tmp_path, {**BASE, "input": {"uri": "x", "prompt_template": "Q: {}"}}))
    spec = load_job(write(tmp_path, {**BASE, "input": {"uri": "x", "prompt_template": "{a} {b.c} {d[0]} {a:>3}",
                                                        "passthrough": ["e"]}}))
    assert spec.input.template_fields() == ["a", "b", "d"]
    assert spec.input.columns() == ["a", "b", "d", "e"]


def test_set_overrides_are_yaml_typed(tmp_path):
    path = write(tmp_path, BASE)
    spec = load_job(path, ["engine.max_num_seqs=64", "sampling.temperature=0", "sampling.stop=[END, '###']",
                           "input.chat=true", "plan.order=input", "engine.max_model_len=null"])
    assert spec.engine.max_num_seqs == 64 and isinstance(spec.engine.max_num_seqs, int)
    assert spec.sampling.temperature == 0.0
    assert spec.sampling_params().stop == ["END", "###"]
    assert spec.input.chat is True and spec.plan.order == "input"
    assert spec.engine.max_model_len is None


def test_set_unknown_key_and_malformed(tmp_path):
    path = write(tmp_path, BASE)
    with pytest.raises(JobError, match=r"engine\.max_num_seq: unknown key, did you mean max_num_seqs\?"):
        load_job(path, ["engine.max_num_seq=64"])
    with pytest.raises(JobError, match="expected key.path=value"):
        load_job(path, ["engine.max_num_seqs"])


def test_parse_job_from_dict():
    spec = parse_job({**BASE, "name": "ok-name.1"}, "<dict>", "/base")
    assert spec.model.path == "/base/m"
    with pytest.raises(JobError, match="name"):
        parse_job({**BASE, "name": "bad name/"}, "<dict>")


def test_every_example_job_file_validates():
    jobs = os.path.join(os.path.dirname(os.path.dirname(__file__)), "jobs")
    files = sorted(f for f in os.listdir(jobs) if f.endswith(".yaml"))
    assert len(files) >= 3
    for f in files:
        load_job(os.path.join(jobs, f))


def test_one_default_per_knob_the_job_file_gets_engine_configs_own(tmp_path):
    """An unset engine knob is EngineConfig's default, whether it comes from a job file or the Python API."""
    path = write(tmp_path, BASE)
    kw = load_job(path).engine_kwargs()
    assert kw == {k: getattr(EngineConfig(), k) for k in kw}
    assert kw["enable_prefix_caching"] is EngineConfig().enable_prefix_caching is True
    assert load_job(path, ["engine.enable_prefix_caching=false"]).engine_kwargs()["enable_prefix_caching"] is False


def test_a_validated_spec_is_never_changed_a_new_one_is_made(tmp_path):
    from pydantic import ValidationError
    data = {**BASE, "input": {"format": "openai_batch", "uri": "in.jsonl"}}
    before = yaml.safe_dump(data)
    spec = parse_job(data, "<dict>", str(tmp_path))
    assert yaml.safe_dump(data) == before                        # the caller's mapping is untouched too
    assert (spec.input.id_column, spec.input.messages_column) == ("custom_id", "messages")
    assert spec.input._base_dir == str(tmp_path)
    for section, key, value in (("model", "path", "x"), ("runtime", "backend", "ray"), ("engine", "max_num_seqs", 1)):
        with pytest.raises(ValidationError, match="frozen"):
            setattr(getattr(spec, section), key, value)
