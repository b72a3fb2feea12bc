"""Hostile model directories and GGUF files: each is exit 3 and one line naming the file (and the key or
tensor where there is one), found before any weight loads. The GGUF file is converted from the suite's
tiny model by tests/gguf_util.py, as llama.cpp's converter would write it."""
from __future__ import annotations

import json
import os
import shutil
import types

import pytest

import gguf_util as gu
from hostile_util import fails, invoke, job
from test_job_common import tiny_model, write_prompt_files  # noqa: F401 - fixture


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory, tiny_model) -> str:  # noqa: F811
    """The tiny model as an F32 GGUF file (config and tokenizer in its metadata)."""
    from safetensors.torch import load_file
    with open(os.path.join(tiny_model, "config.json")) as f:
        cfg = types.SimpleNamespace(**json.load(f))
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    weights = load_file(os.path.join(tiny_model, "model.safetensors"))
    model = types.SimpleNamespace(config=cfg, state_dict=lambda: weights)
    path = str(tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    return gu.write_gguf(path, "llama", gu.metadata(cfg, "llama"), gu.tensors(model, "llama", "F32"),
                         tokenizer_dir=tiny_model)


@pytest.fixture
def d(tmp_path):
    write_prompt_files(str(tmp_path / "in"), 10, files=1)
    return tmp_path


def model_copy(d, tiny_model) -> str:  # noqa: F811
    return shutil.copytree(tiny_model, str(d / "m"))


def cut(path: str, keep: int) -> None:
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[:keep if keep >= 0 else len(data) + keep])


def check(d, model: str, *needles: str, code: int = 3) -> str:
    return fails(invoke("validate", job(d, model, "in")), code, *needles)


def test_model_path_missing(d):
    check(d, str(d / "nope"), "model.path", str(d / "nope"))


def test_config_json_missing(d, tiny_model):  # noqa: F811
    m = model_copy(d, tiny_model)
    os.remove(os.path.join(m, "config.json"))
    check(d, m, "config.json: missing")


@pytest.mark.parametrize("text, needle", [("{\"architectures\": [", "not valid JSON"),
                                          ("[1, 2]", "expected a JSON object, found list"),
                                          (b"{\"a\": \"\xff\"}", "not UTF-8")])
def test_config_json_unreadable(d, tiny_model, text, needle):  # noqa: F811
    m = model_copy(d, tiny_model)
    with open(os.path.join(m, "config.json"), "wb") as f:
        f.write(text if isinstance(text, bytes) else text.encode())
    check(d, m, os.path.join(m, "config.json"), needle)


def test_config_dtype_batchrun_cannot_load(d, tiny_model):  # noqa: F811
    m = model_copy(d, tiny_model)
    cfg = json.load(open(os.path.join(m, "config.json")))
    cfg["dtype"] = "float8_e4m3fn"
    json.dump(cfg, open(os.path.join(m, "config.json"), "w"))
    assert invoke("validate", job(d, m, "in")).code == 0      # the job's own dtype, float32, wins
    fails(invoke("validate", job(d, m, "in", model={"path": m, "dtype": "auto"})), 3, "model.path", "float8_e4m3fn")


def test_unsupported_architecture(d, tiny_model):  # noqa: F811
    m = model_copy(d, tiny_model)
    cfg = json.load(open(os.path.join(m, "config.json")))
    cfg["architectures"] = ["FalconForCausalLM"]
    json.dump(cfg, open(os.path.join(m, "config.json"), "w"))
    check(d, m, "config.json", "FalconForCausalLM", "not supported")


@pytest.mark.parametrize("keep", [20, -1000], ids=["header-cut-short", "data-cut-short"])
def test_truncated_safetensors(d, tiny_model, keep):  # noqa: F811
    """Reported: a model.safetensors cut inside its header raised SafetensorError as a traceback."""
    m = model_copy(d, tiny_model)
    weights = os.path.join(m, "model.safetensors")
    cut(weights, keep)
    check(d, m, weights, "truncated or corrupt")


def test_only_a_pickle_checkpoint(d, tiny_model):  # noqa: F811
    m = model_copy(d, tiny_model)
    os.rename(os.path.join(m, "model.safetensors"), os.path.join(m, "pytorch_model.bin"))
    check(d, m, "pytorch_model.bin", "safetensors only")


@pytest.mark.parametrize("damage, needle", [("remove", "tokenizer"), ("garbage", "tokenizer")])
def test_tokenizer_missing_or_corrupt(d, tiny_model, damage, needle):  # noqa: F811
    m = model_copy(d, tiny_model)
    path = os.path.join(m, "tokenizer.json")
    if damage == "remove":
        os.remove(path)
    else:
        with open(path, "w") as f:
            f.write("{\"model\": ")
    check(d, m, "model.path", m, needle)


@pytest.mark.parametrize("keep", [100, 5000, -1000], ids=["magic+header", "metadata", "tensor-data"])
def test_truncated_gguf(d, gguf_file, keep):
    path = str(d / "cut.gguf")
    shutil.copy(gguf_file, path)
    cut(path, keep)
    check(d, path, path, "not a readable GGUF file, truncated or corrupt")


def test_gguf_of_another_architecture(d, gguf_file):
    import gguf
    src = gguf.GGUFReader(gguf_file)
    meta = {f.name: f.contents() for f in src.fields.values() if f.name.startswith("llama.")}
    tensors = [(t.name, t.data, t.tensor_type.name) for t in src.tensors]
    path = gu.write_gguf(str(d / "falcon.gguf"), "falcon", meta, tensors)
    check(d, path, path, "architecture 'falcon'", "general.architecture")


def test_directory_with_two_gguf_files(d, gguf_file):
    (d / "g").mkdir()
    shutil.copy(gguf_file, d / "g" / "a.gguf")
    shutil.copy(gguf_file, d / "g" / "b.gguf")
    check(d, str(d / "g"), "several GGUF files", "a.gguf, b.gguf")
