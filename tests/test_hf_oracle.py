"""tests/hf_oracle.py: the cached conversion is transformers' own model of the GGUF, bit for bit (the same
tensors and logits as `from_pretrained(gguf_file=...)`), made once per file version and reused after."""
import os
import warnings

import pytest
import torch

import gguf_util as gu
import hf_oracle
from conftest import build_hf_model


@pytest.fixture()
def tiny_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    d = str(tmp_path / "model")
    return gu.model_gguf(build_hf_model("llama", d), "llama", "Q8_0", d, d)


def test_the_cached_model_is_transformers_model_of_the_file(tiny_gguf):
    import transformers as tf
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        direct = tf.AutoModelForCausalLM.from_pretrained(os.path.dirname(tiny_gguf),
                                                         gguf_file=os.path.basename(tiny_gguf),
                                                         dtype=torch.float32).eval()
    cached = hf_oracle.hf_model_of_gguf(tiny_gguf)
    assert type(cached) is type(direct) and getattr(cached, "hf_quantizer", None) is None
    a, b = direct.state_dict(), cached.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ids = torch.tensor([[3, 17, 42, 99, 5]])
    with torch.no_grad():
        assert torch.equal(direct(ids).logits, cached(ids).logits)


def test_a_second_load_converts_nothing_and_a_changed_file_reconverts(tiny_gguf, monkeypatch):
    first = hf_oracle.oracle_dir(tiny_gguf)
    hf_oracle.hf_model_of_gguf(tiny_gguf)
    real = hf_oracle._convert

    def refuse(*a, **k):
        raise AssertionError("converted again")
    monkeypatch.setattr(hf_oracle, "_convert", refuse)
    hf_oracle.hf_model_of_gguf(tiny_gguf)                   # loads the saved folder
    monkeypatch.setattr(hf_oracle, "_convert", real)
    st = os.stat(tiny_gguf)
    os.utime(tiny_gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))   # a new copy of the file
    second = hf_oracle.oracle_dir(tiny_gguf)
    assert second != first
    hf_oracle.hf_model_of_gguf(tiny_gguf)
    assert os.path.isdir(second) and not os.path.exists(first)     # the older conversion is gone
    assert sorted(os.listdir(hf_oracle.cache_root())) == sorted([os.path.basename(second), "model-Q8_0.lock"])
