"""GGUF models (batchrun.models.gguf) against transformers, on synthetic files written by tests/gguf_util.py.

- every tensor type's dequantisation equals gguf.quants.dequantize on the same bytes;
- F32/F16/BF16 files of conftest's tiny models (llama with llama3 rope as `rope_freqs`, qwen2, qwen3,
  Mistral as llama) generate greedily what transformers generates with the original model (BF16: with the
  original's weights rounded to bfloat16, which is what the file holds);
- quantized files generate what transformers generates loading the *same* file (gguf_file=); where it
  cannot (llama3 `rope_freqs`, qwen3 head_dim != 128), what an HF model given the dequantised weights does;
- bad files fail with one line naming the file and the key or tensor, also through the CLI (exit 3).
"""
from __future__ import annotations

import copy
import os
import shutil
import warnings

import numpy as np
import pytest
import torch

import gguf_util as gu
from batchrun import LLM, SamplingParams
from batchrun.models.gguf import hf_name, inspect_gguf, iter_gguf_weights, open_reader
from batchrun.models.loader import ModelError, inspect_model
from conftest import ARCHS, hf_greedy, mixed_prompts

PROMPTS = mixed_prompts(6, 150, seed=3)
MAX_TOKENS = 24


def ours(path: str) -> list[list[int]]:
    llm = LLM(path, dtype="float32", kv_cache_memory=16 << 20, swap_space=0, max_num_seqs=8,
              max_num_batched_tokens=512)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True), use_tqdm=False)
    return [o.token_ids for o in outs]


def hf_from_gguf(path: str):
    import transformers as tf
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tf.AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                       dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tiny(hf_models):
    """{arch: (dir, hf model, transformers' greedy outputs)} for conftest's tiny models."""
    return {arch: (path, hf, hf_greedy(hf, PROMPTS, MAX_TOKENS)) for arch, (path, hf) in hf_models.items()}


@pytest.fixture(scope="module")
def kquant(tmp_path_factory):
    """{arch: (dir, hf model)}: tiny models whose matrix rows are multiples of 256 (K-quant super-blocks)."""
    out = {}
    for arch in ("llama", "qwen2", "qwen3"):
        d = str(tmp_path_factory.mktemp(f"kq-{arch}"))
        out[arch] = (d, gu.kquant_hf_model(arch, d))
    return out


@pytest.mark.parametrize("qtype", gu.FLOAT_TYPES + gu.QUANT_TYPES)
def test_dequantisation_equals_gguf_reference(kquant, qtype):
    d, hf = kquant["llama"]
    path = gu.model_gguf(hf, "llama", qtype, d, d)
    reader = open_reader(path)
    info = inspect_gguf(path)
    raw = {t.name: t for t in reader.tensors}
    ours = dict(iter_gguf_weights(info))
    assert set(info.tensor_types) == ({"F32", qtype} if qtype != "F32" else {"F32"})
    assert sum(n for n, _ in info.tensor_types.values()) == len(raw)
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            continue
        want = _dq(t.data, t.tensor_type.name).reshape(tuple(reversed(t.shape.tolist())))
        got = ours[hf_name(t.name)].numpy()
        if ".attn_q." in t.name or ".attn_k." in t.name:   # we undo the converter's permutation
            got = gu.permute(got, 4 if ".attn_q." in t.name else 2)
        assert np.array_equal(got, want), t.name


@pytest.mark.parametrize("qtype", gu.FLOAT_TYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_float_files_match_the_original_hf_model(tiny, tmp_path, arch, qtype):
    d, hf, want = tiny[arch]
    path = gu.model_gguf(hf, arch, qtype, str(tmp_path), d)
    if qtype == "BF16":   # the file holds bf16-rounded matrices (1-D tensors stay F32): so does the oracle
        rounded = copy.deepcopy(hf)
        with torch.no_grad():
            for p in rounded.parameters():
                if p.ndim == 2:
                    p.copy_(p.bfloat16().float())
        want = hf_greedy(rounded, PROMPTS, MAX_TOKENS)
    assert ours(path) == want


@pytest.mark.parametrize("qtype", gu.QUANT_TYPES)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_quantized_files_match_transformers_on_the_same_file(kquant, arch, qtype):
    d, hf = kquant[arch]
    path = gu.model_gguf(hf, arch, qtype, d, d)
    got = ours(path)
    assert len({t for g in got for t in g}) > 40          # not a degenerate model
    assert got == hf_greedy(hf_from_gguf(path), PROMPTS, MAX_TOKENS)


@pytest.mark.parametrize("arch,qtype", [("llama", "Q4_1"), ("qwen3", "Q8_0"), ("mistral", "Q4_0")])
def test_quantized_files_transformers_cannot_load(tiny, tmp_path, arch, qtype):
    """transformers ignores `rope_freqs` (llama3 scaling), assumes head_dim 128 for qwen3 and a 4096 window for
    Mistral: the oracle is the HF model given the file's dequantised weights."""
    d, hf, _ = tiny[arch]
    path = gu.model_gguf(hf, arch, qtype, str(tmp_path), d)
    assert ours(path) == hf_greedy(gu.dequantised_hf(hf, path), PROMPTS, MAX_TOKENS)


def test_config_from_metadata(tiny, tmp_path):
    cfgs = {arch: inspect_gguf(gu.model_gguf(tiny[arch][1], arch, "F16", str(tmp_path / arch))).config
            for arch in ARCHS}
    assert cfgs["llama"]["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 128.0}
    assert cfgs["llama"]["architectures"] == ["LlamaForCausalLM"] and not cfgs["llama"]["tie_word_embeddings"]
    assert cfgs["qwen2"]["tie_word_embeddings"] and cfgs["qwen2"]["attention_bias"]
    assert cfgs["qwen3"]["head_dim"] == 32 and cfgs["qwen3"]["rope_theta"] == 1e6
    assert cfgs["mistral"]["architectures"] == ["MistralForCausalLM"] and cfgs["mistral"]["sliding_window"] == 96
    for arch, cfg in cfgs.items():
        assert (cfg["vocab_size"], cfg["max_position_embeddings"], cfg["bos_token_id"], cfg["eos_token_id"]) == \
            (512, 1024, 1, 2), arch


def test_safetensors_report_their_on_disk_dtype(tiny):
    info = inspect_model(tiny["qwen3"][0])        # saved in float32, sharded
    assert set(info.tensor_types) == {"F32"} and info.format == "safetensors"
    assert info.tensor_types["F32"][1] == 4 * info.num_params


# -- bad files --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def parts(tiny):
    _, hf, _ = tiny["llama"]
    return gu.metadata(hf.config, "llama"), gu.tensors(hf, "llama", "Q8_0")


def _bad(tmp_path, meta, tensors, arch="llama"):
    return gu.write_gguf(str(tmp_path / "bad.gguf"), arch, meta, tensors)


def _fails(path: str, *fragments: str) -> str:
    with pytest.raises(ModelError) as e:
        inspect_model(path)
    msg = str(e.value)
    assert "\n" not in msg and path in msg and all(f in msg for f in fragments), msg
    return msg


def test_truncated_and_corrupt_files(tmp_path, parts):
    good = _bad(tmp_path, *parts)
    data = open(good, "rb").read()
    for n in (0, 10, 300, len(data) // 2, len(data) - 7):
        cut = str(tmp_path / f"cut{n}.gguf")
        open(cut, "wb").write(data[:n])
        _fails(cut, "not a readable GGUF file, truncated or corrupt")
    junk = str(tmp_path / "junk.gguf")
    open(junk, "wb").write(b"GGML" + bytes(range(256)) * 8)
    _fails(junk, "not a readable GGUF file", "magic")


def test_bad_metadata_and_tensors(tmp_path, parts):
    meta, tensors = parts
    _fails(_bad(tmp_path, {k.replace("llama.", "gpt2."): v for k, v in meta.items()}, tensors, "gpt2"),
           "architecture 'gpt2'", "general.architecture")
    _fails(_bad(tmp_path, {k: v for k, v in meta.items() if k != "llama.embedding_length"}, tensors),
           "metadata key 'llama.embedding_length' is missing")
    _fails(_bad(tmp_path, meta | {"llama.rope.freq_base": "fast"}, tensors), "'llama.rope.freq_base'", "'fast'")
    _fails(_bad(tmp_path, meta | {"llama.feed_forward_length": 96}, tensors),
           "tensor 'blk.0.ffn_gate.weight' has shape (128, 64), expected (96, 64)")
    q5 = [(n, gu.quantize(d if k == "F32" else _dq(d, k), gu.Q.Q5_0), "Q5_0") if n == "blk.1.ffn_up.weight"
          else (n, d, k) for n, d, k in tensors]
    _fails(_bad(tmp_path, meta, q5), "tensor 'blk.1.ffn_up.weight' has type Q5_0")
    _fails(_bad(tmp_path, meta, [t for t in tensors if t[0] != "blk.1.attn_v.weight"]),
           "tensors missing: blk.1.attn_v.weight")
    _fails(_bad(tmp_path, meta, tensors + [("blk.0.ffn_extra.weight", np.zeros((4, 64), np.float32), "F32")]),
           "unexpected tensor 'blk.0.ffn_extra.weight'")


def _dq(data, kind):
    from gguf.quants import dequantize
    return dequantize(data, gu.Q[kind])


def test_directory_with_one_gguf(tmp_path, parts, tiny):
    (tmp_path / "one").mkdir()
    path = gu.write_gguf(str(tmp_path / "one" / "m.gguf"), "llama", *parts, tokenizer_dir=tiny["llama"][0])
    info = inspect_model(str(tmp_path / "one"))
    assert info.path.endswith("m.gguf") and info.format == "gguf"
    assert info.identity == inspect_model(path).identity
    shutil.copy(path, tmp_path / "one" / "n.gguf")
    with pytest.raises(ModelError, match="several GGUF files .*m.gguf, n.gguf"):
        inspect_model(str(tmp_path / "one"))


def test_identity_changes_with_the_header(tmp_path, parts):
    a = _bad(tmp_path, *parts)
    before = inspect_gguf(a).identity
    b = gu.write_gguf(str(tmp_path / "b.gguf"), "llama", parts[0] | {"llama.context_length": 1000}, parts[1])
    after = inspect_gguf(b).identity
    assert before["bytes"] == after["bytes"] and before["sha256_header_and_edges"] != after["sha256_header_and_edges"]


@pytest.mark.parametrize("command", ["validate", "submit"])
def test_cli_bad_gguf_exits_3_in_one_line(tmp_path, parts, command):
    from jobutil import cli, write_job, write_parquet_files
    meta, tensors = parts
    bad = _bad(tmp_path, meta | {"llama.feed_forward_length": 96}, tensors)
    write_parquet_files(str(tmp_path / "in"), [{"id": i, "text": "hi"} for i in range(4)], 1)
    job = write_job(str(tmp_path / "job.yaml"), bad, str(tmp_path / "in"), str(tmp_path / "out"),
                    input__passthrough=[])
    r = cli(command, job)
    assert r.returncode == 3, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr and bad in lines[0]
    assert "tensor 'blk.0.ffn_gate.weight' has shape (128, 64)" in lines[0]
    assert not (tmp_path / "out").exists() or not os.listdir(tmp_path / "out")
