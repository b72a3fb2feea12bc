"""batchrun.demo: the demo model loads in HF transformers (names and shapes right), runs, and our engine
agrees with it; the tokenizer round-trips; the prompts file and job file have the documented schema."""
from __future__ import annotations

import json
import os

import pyarrow.parquet as pq
import pytest
import torch
import yaml
from safetensors import safe_open

from batchrun.demo import build_tokenizer, demo_corpus, write_demo_job, write_demo_model, write_demo_prompts
from batchrun.tokenizer import Tokenizer

tf = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def job_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("demo-job"))
    return d, write_demo_job(d, model="random")


@pytest.fixture(scope="module")
def model_dir(job_dir):
    return os.path.join(job_dir[0], "model")


def test_model_loads_in_transformers_with_every_weight(model_dir):
    hf, info = tf.LlamaForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    assert hf.config.hidden_size == cfg["hidden_size"] == 256 and hf.config.num_hidden_layers == 4
    assert hf.config.num_key_value_heads == 2 and hf.config.tie_word_embeddings is False
    # every tensor in the file is one HF parameter, bit for bit
    state = hf.state_dict()
    with safe_open(os.path.join(model_dir, "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert names == set(state)
        for name in names:
            assert torch.equal(f.get_tensor(name), state[name]), name


def test_model_forward_runs_and_logits_are_not_ties(model_dir):
    hf = tf.LlamaForCausalLM.from_pretrained(model_dir).eval()
    tok = Tokenizer.from_dir(model_dir)
    ids = torch.tensor([tok.encode("The curious teacher reads the ancient book near the river.")])
    with torch.no_grad():
        logits = hf(ids).logits[0]
    assert logits.shape == (ids.shape[1], 2048)
    assert torch.isfinite(logits).all()
    assert logits.std(dim=-1).min() > 1.0          # spread over several units, not near-uniform
    top2 = logits.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).median() > 0.1  # greedy choices are not coin flips


def test_config_and_generation_config_match_tokenizer(model_dir):
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    gen = json.load(open(os.path.join(model_dir, "generation_config.json")))
    hf_tok = tf.AutoTokenizer.from_pretrained(model_dir)
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    for key in ("rope_theta", "rms_norm_eps", "max_position_embeddings", "num_key_value_heads"):
        assert key in cfg
    assert cfg["bos_token_id"] == gen["bos_token_id"] == hf_tok.bos_token_id
    assert cfg["eos_token_id"] == hf_tok.eos_token_id and gen["eos_token_id"] == [hf_tok.eos_token_id]
    assert cfg["pad_token_id"] == hf_tok.pad_token_id
    assert len(hf_tok) <= cfg["vocab_size"]
    assert Tokenizer.from_dir(model_dir).eos_token_ids == [hf_tok.eos_token_id]


def test_our_engine_matches_transformers_greedy_on_demo_model(model_dir):
    from batchrun import LLM, SamplingParams
    prompts = ["Summarize: the quiet river", "Summarize: " + " ".join(demo_corpus(5, seed=3))]
    llm = LLM(model_dir, dtype="float32")
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False)
    hf = tf.LlamaForCausalLM.from_pretrained(model_dir).eval()
    hf_tok = tf.AutoTokenizer.from_pretrained(model_dir)
    for p, o in zip(prompts, outs):
        ids = hf_tok(p, return_tensors="pt").input_ids
        with torch.no_grad():
            ref = hf.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False)[0, ids.shape[1]:]
        assert o.token_ids == ref.tolist()


def test_tokenizer_roundtrip_and_matches_transformers(model_dir):
    ours, hf = Tokenizer.from_dir(model_dir), tf.AutoTokenizer.from_pretrained(model_dir)
    texts = demo_corpus(50, seed=9) + ["naïve 🌍 你好", "", "  spaces  ", "Summarize: x\ny"]
    enc = ours.encode_batch(texts)
    assert enc == hf(texts)["input_ids"]
    assert all(e[0] == ours.bos_token_id for e in enc)      # <s> prepended (TemplateProcessing)
    assert ours.decode_batch(enc) == texts                   # byte-level BPE is lossless
    assert ours.vocab_size == 2048
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert ours.apply_chat_template(chat) == hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(chat).startswith("<s>")


def test_build_tokenizer_is_deterministic_and_sized(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    build_tokenizer(str(a), vocab_size=512)
    build_tokenizer(str(b), vocab_size=512)
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    tok = Tokenizer.from_dir(str(a))
    assert tok.vocab_size == 512
    assert (tok.token_to_id("<pad>"), tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    cfg = json.load(open(a / "tokenizer_config.json"))
    assert cfg["add_bos_token"] is True and cfg["bos_token"] == "<s>" and "chat_template" in cfg
    with pytest.raises(ValueError, match="vocab_size"):
        build_tokenizer(str(tmp_path / "c"), vocab_size=100)


def test_build_tokenizer_custom_corpus(tmp_path):
    build_tokenizer(str(tmp_path), vocab_size=300, corpus=["zebra zebra zebra quokka"] * 20)
    tok = Tokenizer.from_dir(str(tmp_path))
    assert len(tok.encode("zebra", add_special_tokens=False)) == 1   # merged from the custom corpus


def test_prompts_parquet_schema(job_dir, tmp_path):
    t = pq.read_table(os.path.join(job_dir[0], "prompts.parquet"))
    assert t.schema.names == ["id", "text", "topic"]
    assert [str(x) for x in t.schema.types] == ["int64", "string", "string"]
    assert t.num_rows == 200
    assert t.column("id").to_pylist() == list(range(200))
    lengths = [len(s.split()) for s in t.column("text").to_pylist()]
    assert min(lengths) >= 5 and max(lengths) <= 200 and len(set(lengths)) > 30
    assert t.column("topic").null_count == 0 and len(set(t.column("topic").to_pylist())) > 1
    # deterministic for a seed, different across seeds
    write_demo_prompts(str(tmp_path / "a.parquet"), n=20, seed=5)
    write_demo_prompts(str(tmp_path / "b.parquet"), n=20, seed=5)
    write_demo_prompts(str(tmp_path / "c.parquet"), n=20, seed=6)
    a, b, c = (pq.read_table(str(tmp_path / f"{x}.parquet")) for x in "abc")
    assert a.equals(b) and not a.equals(c) and a.num_rows == 20


def test_job_yaml_parses_and_points_at_real_files(job_dir):
    d, job = job_dir
    assert job == os.path.join(d, "job.yaml")
    spec = yaml.safe_load(open(job))
    assert spec["name"] == "demo"
    assert spec["model"] == {"path": "./model", "dtype": "float32"}
    assert spec["input"]["chat"] is False and spec["input"]["prompt_template"] == "Summarize: {text}"
    assert spec["sampling"] == {"max_tokens": 32, "temperature": 0.0}
    assert spec["engine"] == {"max_num_seqs": 64} and spec["plan"] == {"unit_rows": 50}
    assert spec["output"]["uri"] == "./out/"
    assert os.path.exists(os.path.join(d, spec["model"]["path"], "config.json"))
    table = pq.read_table(os.path.join(d, spec["input"]["uri"]))
    for col in [spec["input"]["id_column"], spec["input"]["prompt_column"], *spec["input"]["passthrough"]]:
        assert col in table.schema.names
    assert "#" in open(job).read()   # documented with comments


def test_write_demo_model_options(tmp_path):
    d = write_demo_model(str(tmp_path), hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4,
                         intermediate_size=96, vocab_size=512, dtype="bfloat16", seed=1)
    assert d == str(tmp_path)
    hf = tf.LlamaForCausalLM.from_pretrained(d, dtype=torch.bfloat16)
    assert hf.model.embed_tokens.weight.shape == (512, 64)
    assert hf.model.layers[0].self_attn.k_proj.weight.shape == (64, 64)
    with safe_open(os.path.join(d, "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("model.norm.weight").dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        write_demo_model(str(tmp_path / "x"), dtype="int8")
