"""batchrun.tokenizer against transformers (the oracle): ids, text, rendered chats, special tokens, errors.

Each fixture writes a real model-style directory (tokenizer.json trained with `tokenizers`, tokenizer_config.json,
optional chat_template.jinja / generation_config.json / config.json) that both sides load from disk.
"""
from __future__ import annotations

import json
import os
import random

import jinja2
import pytest
from tokenizers import AddedToken
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

from batchrun.demo import build_tokenizer, demo_corpus
from batchrun.tokenizer import Tokenizer, TokenizerError

tf = pytest.importorskip("transformers")

TEXTS = [
    "", " ", "a", "Hello world", "Hello, world!  How are you?", "  leading and trailing  ",
    "naïve café – “quotes” and ‘apostrophes’", "你好，世界。こんにちは", "emoji 🌍🚀 and ZWJ 👩‍👩‍👧 family",
    "tabs\tand\nnewlines\r\nand\u00a0nbsp", "<s> inline special </s> tokens <|im_end|> <|eot_id|>",
    "don't won't it's we've they're I'm", "Numbers 12345 3.14159 -7 1e10", "x" * 500,
    "Ünïcödé ÀÉÎÕÜ ßøåæ ŁŚŻ Ωμέγα Привет мир", "the teacher reads the quiet river near the station.",
]

MULTI_TURN = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?", "name": "Ann"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3+3? Answer in 日本語 <b>please</b>."},
]
NO_SYSTEM = [{"role": "user", "content": "Hi there"}]
TWO_TURNS = [{"role": "user", "content": "  padded question  "}, {"role": "assistant", "content": "answer"},
             {"role": "user", "content": "follow-up", "name": None}]   # None-valued keys count as absent
CONVERSATIONS = [MULTI_TURN, NO_SYSTEM, TWO_TURNS]

QWEN_TEMPLATE = """{%- if tools %}
<|im_start|>system
{{ messages[0]['content'] if messages[0]['role'] == 'system' else 'You are a helpful assistant.' }}

# Tools
{% for tool in tools %}
{{ tool | tojson }}
{% endfor %}
<|im_end|>
{% elif messages[0]['role'] != 'system' %}
<|im_start|>system
You are a helpful assistant.<|im_end|>
{% endif %}
{%- for message in messages %}
    {%- if message.role == 'system' and tools %}{% continue %}{% endif %}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""

LLAMA3_TEMPLATE = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = strftime_now("%d %b %Y") %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none %}
    {{- "Tools:\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

ALTERNATE_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)

# chat_template.jinja wins over tokenizer_config's template; exercises namespace(), dict(), loop controls,
# the {% generation %} tag and trim_blocks/lstrip_blocks whitespace handling
JINJA_FILE_TEMPLATE = """{% set ns = namespace(turns=0, last='') %}
{% set roles = dict(system='SYS', user='USR', assistant='BOT') %}
{% for message in messages %}
    {% set ns.turns = ns.turns + 1 %}
    {% if message['role'] == 'assistant' %}
[{{ roles[message['role']] }} {{ ns.turns }}] {% generation %}{{ message['content'] }}{% endgeneration %}

    {% else %}
[{{ roles[message['role']] }} {{ ns.turns }}]{% if 'name' in message %} ({{ message['name'] }}){% endif %} {{ message['content'] }}
    {% endif %}
    {% if ns.turns > 10 %}{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}
[BOT {{ ns.turns + 1 }}]{% endif %}
"""

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Wetter für <Stadt> & Umgebung — “heute”",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def _write_json(path, data):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, ensure_ascii=False, indent=2)


def _byte_bpe(special: list[str], vocab_size: int = 1200) -> RawTokenizer:
    tok = RawTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(demo_corpus(1500, seed=1) + TEXTS, trainer=trainer)
    return tok


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("demo-tok"))
    build_tokenizer(d, vocab_size=1024)
    return d


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    """ChatML / Qwen2 style: no BOS, ByteLevel post-processor, eos from generation_config (list) + config."""
    d = str(tmp_path_factory.mktemp("qwen-tok"))
    tok = _byte_bpe(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.save(os.path.join(d, "tokenizer.json"))
    _write_json(os.path.join(d, "tokenizer_config.json"), {
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "chat_template": QWEN_TEMPLATE, "model_max_length": 32768, "clean_up_tokenization_spaces": False})
    ids = {t: tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_end|>")}
    _write_json(os.path.join(d, "generation_config.json"),
                {"eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]], "pad_token_id": ids["<|endoftext|>"]})
    _write_json(os.path.join(d, "config.json"), {"eos_token_id": ids["<|endoftext|>"]})
    return d


@pytest.fixture(scope="module")
def llama3_dir(tmp_path_factory):
    """Llama-3 style: BOS from a TemplateProcessing post-processor, AddedToken-dict special tokens, and a
    named special token (<|finetune_right_pad_id|>) that tokenizer.json lacks, so it gets a new id."""
    d = str(tmp_path_factory.mktemp("llama3-tok"))
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    tok = _byte_bpe([])
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|>:1 $B:1",
        special_tokens=[("<|begin_of_text|>", tok.token_to_id("<|begin_of_text|>"))])
    tok.save(os.path.join(d, "tokenizer.json"))

    def added(content):
        return {"__type": "AddedToken", "content": content, "lstrip": False, "rstrip": False,
                "normalized": False, "single_word": False, "special": True}
    _write_json(os.path.join(d, "tokenizer_config.json"), {
        "bos_token": added("<|begin_of_text|>"), "eos_token": added("<|eot_id|>"),
        "pad_token": "<|finetune_right_pad_id|>", "chat_template": LLAMA3_TEMPLATE,
        "model_max_length": 131072})
    _write_json(os.path.join(d, "generation_config.json"),
                {"eos_token_id": [tok.token_to_id("<|end_of_text|>"), tok.token_to_id("<|eot_id|>")]})
    _write_json(os.path.join(d, "config.json"), {"eos_token_id": tok.token_to_id("<|end_of_text|>")})
    return d


@pytest.fixture(scope="module")
def alternate_dir(tmp_path_factory, demo_dir):
    d = str(tmp_path_factory.mktemp("alt-tok"))
    _copy_tokenizer(demo_dir, d, chat_template=ALTERNATE_TEMPLATE)
    return d


@pytest.fixture(scope="module")
def jinja_dir(tmp_path_factory, demo_dir):
    d = str(tmp_path_factory.mktemp("jinja-tok"))
    _copy_tokenizer(demo_dir, d)   # keeps the demo template in tokenizer_config.json
    with open(os.path.join(d, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(JINJA_FILE_TEMPLATE)
    return d


@pytest.fixture(scope="module")
def wordpiece_dir(tmp_path_factory):
    """A BERT-like WordPiece model with clean_up_tokenization_spaces (applied on decode for non-BPE models)."""
    d = str(tmp_path_factory.mktemp("wp-tok"))
    tok = RawTokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(vocab_size=800, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"],
                                        show_progress=False)
    tok.train_from_iterator(demo_corpus(1500, seed=2), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", tok.token_to_id("[CLS]")), ("[SEP]", tok.token_to_id("[SEP]"))])
    tok.save(os.path.join(d, "tokenizer.json"))
    _write_json(os.path.join(d, "tokenizer_config.json"), {
        "cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]", "unk_token": "[UNK]",
        "mask_token": "[MASK]", "clean_up_tokenization_spaces": True})
    return d


def _copy_tokenizer(src, dst, **config_updates):
    with open(os.path.join(src, "tokenizer.json"), encoding="utf-8") as f:
        data = f.read()
    with open(os.path.join(dst, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(data)
    with open(os.path.join(src, "tokenizer_config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    cfg.update(config_updates)
    _write_json(os.path.join(dst, "tokenizer_config.json"), cfg)


ALL_DIRS = ["demo_dir", "qwen_dir", "llama3_dir", "wordpiece_dir"]


def _pair(request, name):
    d = request.getfixturevalue(name)
    return Tokenizer.from_dir(d), tf.AutoTokenizer.from_pretrained(d)


def _random_id_seqs(vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    seqs = [[], [0], list(range(min(vocab, 40)))]
    seqs += [[rng.randrange(vocab) for _ in range(rng.randint(1, 60))] for _ in range(30)]
    return seqs


# -- encode / decode ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", ALL_DIRS)
def test_encode_matches_transformers(request, name):
    ours, hf = _pair(request, name)
    for special in (True, False):
        for t in TEXTS:
            assert ours.encode(t, add_special_tokens=special) == hf.encode(t, add_special_tokens=special), (t, special)
        assert ours.encode_batch(TEXTS, add_special_tokens=special) == \
            hf(TEXTS, add_special_tokens=special)["input_ids"]
    assert ours.encode_batch([]) == []


@pytest.mark.parametrize("name", ALL_DIRS)
def test_decode_matches_transformers(request, name):
    ours, hf = _pair(request, name)
    seqs = [hf.encode(t) for t in TEXTS] + _random_id_seqs(len(hf), seed=len(name))
    for skip in (True, False):
        expected = [hf.decode(s, skip_special_tokens=skip) for s in seqs]
        assert [ours.decode(s, skip_special_tokens=skip) for s in seqs] == expected
        assert ours.decode_batch(seqs, skip_special_tokens=skip) == expected
        assert hf.batch_decode(seqs, skip_special_tokens=skip) == expected
    assert ours.decode_batch([]) == []


def test_decode_accepts_arrays(demo_dir):
    import numpy as np
    import torch
    ours = Tokenizer.from_dir(demo_dir)
    ids = ours.encode("arrays of ids decode too")
    assert ours.decode(np.array(ids)) == ours.decode(torch.tensor(ids)) == ours.decode(ids)


@pytest.mark.parametrize("name", ALL_DIRS)
def test_special_tokens_match_transformers(request, name):
    ours, hf = _pair(request, name)
    assert ours.vocab_size == len(hf)
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == (hf.bos_token, hf.eos_token, hf.pad_token)
    assert ours.bos_token_id == hf.bos_token_id
    assert ours.eos_token_id == hf.eos_token_id
    assert ours.pad_token_id == hf.pad_token_id
    # add_bos_token says what encode() does; check it against transformers' actual encoding
    assert ours.add_bos_token == (hf.bos_token_id is not None and hf.encode("x")[:1] == [hf.bos_token_id])


def test_add_bos_token(demo_dir, qwen_dir, llama3_dir):
    assert Tokenizer.from_dir(demo_dir).add_bos_token is True
    assert Tokenizer.from_dir(llama3_dir).add_bos_token is True    # from the post-processor, no config flag
    assert Tokenizer.from_dir(qwen_dir).add_bos_token is False


def test_new_named_special_token_gets_transformers_id(llama3_dir):
    ours, hf = Tokenizer.from_dir(llama3_dir), tf.AutoTokenizer.from_pretrained(llama3_dir)
    raw = RawTokenizer.from_file(os.path.join(llama3_dir, "tokenizer.json"))
    assert raw.token_to_id("<|finetune_right_pad_id|>") is None
    assert ours.pad_token_id == hf.pad_token_id == raw.get_vocab_size()
    text = "pad <|finetune_right_pad_id|> here"
    assert ours.encode(text) == hf.encode(text)
    assert ours.pad_token_id in ours.encode(text)


def test_tokenizer_json_only_matches_fast_tokenizer(tmp_path, demo_dir):
    """No tokenizer_config.json: no named special tokens, the post-processor still adds <s>."""
    with open(os.path.join(demo_dir, "tokenizer.json"), encoding="utf-8") as f:
        (tmp_path / "tokenizer.json").write_text(f.read(), encoding="utf-8")
    ours = Tokenizer.from_dir(str(tmp_path))
    hf = tf.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    assert ours.bos_token is ours.eos_token is ours.chat_template is None
    assert ours.eos_token_ids == []
    assert ours.encode_batch(TEXTS) == hf(TEXTS)["input_ids"]
    seqs = [hf.encode(t) for t in TEXTS]
    assert ours.decode_batch(seqs, skip_special_tokens=True) == hf.batch_decode(seqs, skip_special_tokens=True)


# -- EOS ---------------------------------------------------------------------------------------

def test_eos_ids_union_generation_config_config_and_eos_token(qwen_dir, llama3_dir):
    for d in (qwen_dir, llama3_dir):
        hf = tf.AutoTokenizer.from_pretrained(d)
        gen = json.load(open(os.path.join(d, "generation_config.json")))["eos_token_id"]
        cfg = json.load(open(os.path.join(d, "config.json")))["eos_token_id"]
        expected = []
        for i in list(gen) + [cfg, hf.eos_token_id]:
            if i not in expected:
                expected.append(i)
        assert Tokenizer.from_dir(d).eos_token_ids == expected
    qwen = Tokenizer.from_dir(qwen_dir)
    assert qwen.eos_token_ids == [qwen.backend.token_to_id("<|im_end|>"), qwen.backend.token_to_id("<|endoftext|>")]


def test_eos_ids_int_forms_and_bad_values(tmp_path, demo_dir):
    d = str(tmp_path)
    _copy_tokenizer(demo_dir, d)
    _write_json(os.path.join(d, "generation_config.json"), {"eos_token_id": 7})
    _write_json(os.path.join(d, "config.json"), {"eos_token_id": [9, 7]})
    eos_id = Tokenizer.from_dir(d).eos_token_id
    assert Tokenizer.from_dir(d).eos_token_ids == [7, 9, eos_id]
    _write_json(os.path.join(d, "config.json"), {"eos_token_id": "two"})
    with pytest.raises(TokenizerError, match=r"config\.json.*eos_token_id"):
        Tokenizer.from_dir(d)


# -- chat templates ----------------------------------------------------------------------------

def _hf_render(hf, conv, agp, **kw):
    return hf.apply_chat_template(conv, tokenize=False, add_generation_prompt=agp, **kw)


@pytest.mark.parametrize("name", ["demo_dir", "qwen_dir", "llama3_dir", "jinja_dir"])
@pytest.mark.parametrize("agp", [True, False])
def test_chat_template_matches_transformers(request, name, agp):
    d = request.getfixturevalue(name)
    ours, hf = Tokenizer.from_dir(d), tf.AutoTokenizer.from_pretrained(d)
    for conv in CONVERSATIONS:
        expected = _hf_render(hf, conv, agp)
        assert ours.apply_chat_template(conv, add_generation_prompt=agp) == expected
    expected_ids = [hf.encode(_hf_render(hf, c, agp), add_special_tokens=False) for c in CONVERSATIONS]
    assert ours.encode_chat_batch(CONVERSATIONS, add_generation_prompt=agp) == expected_ids
    hf_ids = [hf.apply_chat_template(c, tokenize=True, add_generation_prompt=agp)["input_ids"] for c in CONVERSATIONS]
    assert expected_ids == hf_ids


def test_chat_template_kwargs_tools_and_strftime(qwen_dir, llama3_dir):
    for d in (qwen_dir, llama3_dir):
        ours, hf = Tokenizer.from_dir(d), tf.AutoTokenizer.from_pretrained(d)
        for conv in CONVERSATIONS:
            assert ours.apply_chat_template(conv, tools=TOOLS) == _hf_render(hf, conv, True, tools=TOOLS)
            assert ours.apply_chat_template(conv, date_string="26 Jul 2024") == \
                _hf_render(hf, conv, True, date_string="26 Jul 2024")
    ours = Tokenizer.from_dir(llama3_dir)
    rendered = ours.apply_chat_template(NO_SYSTEM, tools=TOOLS)
    assert "Wetter für <Stadt> & Umgebung" in rendered      # tojson: no HTML escaping, no \\u escapes
    assert '\n    "type": "function"' in rendered            # tojson(indent=4)
    from datetime import datetime
    assert ours.apply_chat_template(NO_SYSTEM, date_string="X").count("Today Date: X") == 1
    assert f"Today Date: {datetime.now().strftime('%d %b %Y')}" in ours.apply_chat_template(NO_SYSTEM)


def test_jinja_file_wins_over_tokenizer_config(jinja_dir, demo_dir):
    ours = Tokenizer.from_dir(jinja_dir)
    assert ours.chat_template == JINJA_FILE_TEMPLATE
    assert ours.apply_chat_template(MULTI_TURN) != Tokenizer.from_dir(demo_dir).apply_chat_template(MULTI_TURN)
    assert ours.apply_chat_template(MULTI_TURN).startswith("[SYS 1] You are terse.\n")


def test_raise_exception_template(alternate_dir):
    ours, hf = Tokenizer.from_dir(alternate_dir), tf.AutoTokenizer.from_pretrained(alternate_dir)
    good = [{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"},
            {"role": "user", "content": "three"}]
    for agp in (True, False):
        assert ours.apply_chat_template(good, add_generation_prompt=agp) == _hf_render(hf, good, agp)
    bad = [{"role": "user", "content": "one"}, {"role": "user", "content": "two"}]
    with pytest.raises(jinja2.exceptions.TemplateError):
        _hf_render(hf, bad, True)
    with pytest.raises(TokenizerError, match="roles must alternate"):
        ours.apply_chat_template(bad)
    with pytest.raises(TokenizerError, match=r"conversation 1: .*roles must alternate"):
        ours.encode_chat_batch([good, bad])


def test_template_runtime_error_is_tokenizer_error(tmp_path, demo_dir):
    d = str(tmp_path)
    _copy_tokenizer(demo_dir, d, chat_template="{{ messages[0]['content'] + 1 }}")
    with pytest.raises(TokenizerError, match="chat template"):
        Tokenizer.from_dir(d).apply_chat_template(NO_SYSTEM)


def test_no_chat_template(tmp_path, demo_dir):
    d = str(tmp_path)
    _copy_tokenizer(demo_dir, d, chat_template=None)
    ours = Tokenizer.from_dir(d)
    assert ours.chat_template is None
    with pytest.raises(ValueError):
        tf.AutoTokenizer.from_pretrained(d).apply_chat_template(NO_SYSTEM, tokenize=False)
    with pytest.raises(TokenizerError, match="no chat template"):
        ours.apply_chat_template(NO_SYSTEM)
    with pytest.raises(TokenizerError, match="no chat template"):
        ours.encode_chat_batch([NO_SYSTEM])


def test_bad_conversations(demo_dir):
    ours = Tokenizer.from_dir(demo_dir)
    with pytest.raises(TokenizerError, match="empty conversation"):
        ours.apply_chat_template([])
    with pytest.raises(TokenizerError, match="message 1"):
        ours.apply_chat_template([{"role": "user", "content": "x"}, "not a dict"])
    with pytest.raises(TokenizerError, match="Unknown role"):
        ours.apply_chat_template([{"role": "robot", "content": "x"}])


def test_template_syntax_error_names_file(tmp_path, demo_dir):
    d = str(tmp_path)
    _copy_tokenizer(demo_dir, d)
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }", encoding="utf-8")
    with pytest.raises(TokenizerError, match=r"chat_template\.jinja.*does not parse"):
        Tokenizer.from_dir(d).apply_chat_template(NO_SYSTEM)


def test_named_templates_list_form(tmp_path, demo_dir):
    d = str(tmp_path)
    _copy_tokenizer(demo_dir, d, chat_template=[
        {"name": "default", "template": "D{% for m in messages %}|{{ m.content }}{% endfor %}"},
        {"name": "tool_use", "template": "T{{ tools | length }}{% for m in messages %}|{{ m.content }}{% endfor %}"}])
    ours, hf = Tokenizer.from_dir(d), tf.AutoTokenizer.from_pretrained(d)
    assert ours.apply_chat_template(MULTI_TURN) == _hf_render(hf, MULTI_TURN, True) == \
        "D|You are terse.|What is 2+2?|4.|And 3+3? Answer in 日本語 <b>please</b>."
    assert ours.apply_chat_template(MULTI_TURN, tools=TOOLS) == _hf_render(hf, MULTI_TURN, True, tools=TOOLS)


def test_template_cannot_escape_sandbox(tmp_path, demo_dir):
    d = str(tmp_path)
    _copy_tokenizer(demo_dir, d, chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(TokenizerError, match="unsafe"):   # the sandbox refuses dunder attributes
        Tokenizer.from_dir(d).apply_chat_template(NO_SYSTEM)
    _copy_tokenizer(demo_dir, d, chat_template="{% set ns = namespace(_x=1) %}{{ ns._x }}")
    with pytest.raises(TokenizerError):
        Tokenizer.from_dir(d).apply_chat_template(NO_SYSTEM)
    _copy_tokenizer(demo_dir, d, chat_template="{% set _ = messages.append(1) %}x")
    with pytest.raises(TokenizerError):   # immutable sandbox: no mutation of the caller's messages
        Tokenizer.from_dir(d).apply_chat_template(NO_SYSTEM)


# -- loading errors ----------------------------------------------------------------------------

def test_missing_tokenizer_json_names_path(tmp_path):
    with pytest.raises(TokenizerError, match=str(tmp_path / "tokenizer.json").replace("\\", "\\\\")):
        Tokenizer.from_dir(str(tmp_path))
    with pytest.raises(TokenizerError, match="not a directory"):
        Tokenizer.from_dir(str(tmp_path / "nope"))


def test_bad_files_name_the_file(tmp_path, demo_dir):
    d = str(tmp_path)
    _copy_tokenizer(demo_dir, d)
    (tmp_path / "tokenizer_config.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json"):
        Tokenizer.from_dir(d)
    _copy_tokenizer(demo_dir, d, eos_token=["</s>"])
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json key 'eos_token'"):
        Tokenizer.from_dir(d)
    _copy_tokenizer(demo_dir, d)
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0"}', encoding="utf-8")
    with pytest.raises(TokenizerError, match=r"tokenizer\.json: cannot load"):
        Tokenizer.from_dir(d)


def test_encode_rejects_non_strings(demo_dir):
    ours = Tokenizer.from_dir(demo_dir)
    with pytest.raises(TokenizerError, match="text 1"):
        ours.encode_batch(["ok", None])
    with pytest.raises(TokenizerError):
        ours.encode(None)
