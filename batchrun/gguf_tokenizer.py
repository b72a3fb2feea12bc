"""The tokenizer and chat template of a GGUF file, rebuilt from its `tokenizer.*` metadata.

A GGUF carries no tokenizer.json: llama.cpp stores the vocabulary (`tokenizer.ggml.tokens`), token kinds
(`token_type`), BPE merges or SentencePiece scores, special token ids and the chat template as metadata.
`tokenizer_from_gguf` builds the `tokenizers` pipeline transformers builds for the same file
(`AutoTokenizer.from_pretrained(dir, gguf_file=...)`), so ids, special tokens and rendered chats match it:

- `gpt2`: byte-level BPE with the file's merges; the split regex follows `tokenizer.ggml.pre` for the
  pre-tokenizers transformers knows (llama-bpe, qwen2, tekken, gpt-4o, ...), GPT-2's regex otherwise;
- `llama`: SentencePiece-style BPE with byte fallback and `▁` for spaces; merges from the file, else rebuilt
  from the token scores; the Phi-3 architecture's variant (a `▁` prefix from a normalizer) too;
- control tokens become special added tokens, user-defined ones plain added tokens; BOS is prepended when
  `add_bos_token` says so (default: yes for `llama`, no for `gpt2`), EOS appended when `add_eos_token` does.

Deliberate differences from transformers: `add_space_prefix = false` is honoured (transformers always
prepends `▁`; llama.cpp, which defines the format, does not), and named special tokens missing from the
vocabulary are not invented (transformers' GPT2/Llama defaults would append `<|endoftext|>`, `<s>`, ...
with ids past the model's embedding table). EOT/EOM ids join `eos_token_ids` so generation stops there.
"""
from __future__ import annotations

import os
from typing import Any, Optional

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers.models import BPE

from batchrun.tokenizer_base import Tokenizer, TokenizerError

SUPPORTED_MODELS = ("gpt2", "llama")
_CONTROL, _USER_DEFINED = 3, 4   # llama.cpp token types (gguf.TokenType)
# architectures whose SentencePiece vocabulary transformers builds differently (not supported here)
_UNSUPPORTED_SPM_ARCHS = ("gemma", "gemma2", "gemma3", "gemma3n", "gemma4")

_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
           r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_TEKKEN = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_GPT4O = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}"
          rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# `tokenizer.ggml.pre` -> split regex, for the names transformers recognises; others keep GPT-2's regex
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2),
    "qwen35": _QWEN35, "tekken": _TEKKEN,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O),
}


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the spelling of byte-level BPE vocabularies)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


class _Metadata:
    """Typed access to a GGUF file's metadata; every problem is a one-line TokenizerError naming file and key."""
    _KINDS = {"str": (8,), "int": (0, 1, 2, 3, 4, 5, 10, 11), "bool": (7,), "float": (6, 12)}

    def __init__(self, file: str):
        self.file = file
        try:     # the reader the model loader uses too (models/gguf.py): one parse of the file per process
            from batchrun.gguf_header import shared_reader
            self._fields = shared_reader(file).fields
        except Exception as e:  # numpy/struct errors on truncated or foreign files
            raise TokenizerError(f"{file}: cannot read GGUF metadata ({_one_line(e)})") from e

    def get(self, key: str, kind: str, array: bool = False, required: bool = False) -> Any:
        field = self._fields.get(key)
        if field is None:
            if required:
                raise TokenizerError(f"{self.file}: metadata key {key!r} is missing")
            return None
        types = [int(t) for t in field.types]
        allowed = self._KINDS[kind]
        if array:   # 9 is GGUFValueType.ARRAY, followed by the element type
            ok = len(types) == 2 and types[0] == 9 and types[1] in allowed
        else:
            ok = len(types) == 1 and types[0] in allowed
        if not ok:
            what = {"str": "string", "int": "integer", "bool": "boolean", "float": "float"}[kind]
            raise TokenizerError(f"{self.file}: metadata key {key!r} is not "
                                 f"{f'an array of {what}s' if array else f'a {what}'} (GGUF value types {types})")
        try:
            value = field.contents()
        except Exception as e:   # e.g. a token that is not UTF-8
            raise TokenizerError(f"{self.file}: metadata key {key!r} cannot be read ({_one_line(e)})") from e
        if kind == "bool":
            return [bool(v) for v in value] if array else bool(value)
        return value


def _one_line(e: BaseException) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())


def tokenizer_from_gguf(file: str) -> Tokenizer:
    """The `Tokenizer` a GGUF file's metadata describes (vocabulary, merges/scores, special tokens, BOS/EOS
    behaviour, chat template), matching transformers' GGUF tokenizer loading.

    Raises TokenizerError (one line naming the file and metadata key) for unreadable files, tokenizer
    types other than `gpt2`/`llama`, and missing or malformed tokenizer metadata.
    """
    file = os.fspath(file)
    meta = _Metadata(file)
    model = meta.get("tokenizer.ggml.model", "str", required=True)
    if model not in SUPPORTED_MODELS:
        raise TokenizerError(f"{file}: metadata key 'tokenizer.ggml.model' is {model!r}; batchrun builds "
                             f"tokenizers of type {', '.join(SUPPORTED_MODELS)} only")
    arch = meta.get("general.architecture", "str") or ""
    if model == "llama" and arch in _UNSUPPORTED_SPM_ARCHS:
        raise TokenizerError(f"{file}: metadata key 'general.architecture' is {arch!r}, whose SentencePiece "
                             "tokenizer variant batchrun does not build")
    tokens = meta.get("tokenizer.ggml.tokens", "str", array=True, required=True)
    if not tokens:
        raise TokenizerError(f"{file}: metadata key 'tokenizer.ggml.tokens' is empty")
    token_types = _per_token(meta, "tokenizer.ggml.token_type", "int", len(tokens))
    scores = _per_token(meta, "tokenizer.ggml.scores", "float", len(tokens))
    merges = meta.get("tokenizer.ggml.merges", "str", array=True)

    if model == "gpt2":
        backend, in_alphabet = _byte_level(meta, tokens, merges)
    else:
        backend, in_alphabet = _sentencepiece(meta, tokens, merges, scores, arch), (lambda _t: True)

    types = token_types or []
    control = [t for t, k in zip(tokens, types) if k == _CONTROL and in_alphabet(t)]
    if control:
        backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    vocab = backend.get_vocab(with_added_tokens=True)
    user = [t for t, k in zip(tokens, types) if k == _USER_DEFINED and t in vocab]
    if user:
        backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])

    specials: dict[str, Optional[str]] = {}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        specials[name] = _token_at(meta, f"tokenizer.ggml.{key}", tokens)
    # transformers' builder classes default these names, which makes them special when the vocab has them
    defaults = ("<|endoftext|>",) if model == "gpt2" else ("<unk>", "<s>", "</s>")
    named = [t for t in defaults if t in vocab] + [t for t in specials.values() if t is not None]
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in dict.fromkeys(named)])

    add_bos = meta.get("tokenizer.ggml.add_bos_token", "bool")
    add_eos = meta.get("tokenizer.ggml.add_eos_token", "bool")
    add_bos = (model == "llama") if add_bos is None else add_bos
    backend.post_processor = _post_processor(backend, specials["bos_token"] if add_bos else None,
                                             specials["eos_token"] if add_eos else None)

    extra_eos = [i for i in (_id(meta, "tokenizer.ggml.eot_token_id", tokens),
                             _id(meta, "tokenizer.ggml.eom_token_id", tokens)) if i is not None]
    template = meta.get("tokenizer.chat_template", "str")
    config = {k: v for k, v in specials.items() if v is not None}
    return Tokenizer(backend, config, path=file, chat_template=template,
                     chat_template_source=f"{file} key 'tokenizer.chat_template'", extra_eos_token_ids=extra_eos)


def _per_token(meta: _Metadata, key: str, kind: str, n: int) -> Optional[list]:
    values = meta.get(key, kind, array=True)
    if values is not None and len(values) != n:
        raise TokenizerError(f"{meta.file}: metadata key {key!r} has {len(values)} entries for {n} tokens")
    return values


def _id(meta: _Metadata, key: str, tokens: list[str]) -> Optional[int]:
    value = meta.get(key, "int")
    if value is not None and not 0 <= value < len(tokens):
        raise TokenizerError(f"{meta.file}: metadata key {key!r} is {value}, outside the "
                             f"{len(tokens)}-token vocabulary")
    return value


def _token_at(meta: _Metadata, key: str, tokens: list[str]) -> Optional[str]:
    i = _id(meta, key, tokens)
    return None if i is None else tokens[i]


def _parse_merges(meta: _Metadata, merges: list[str]) -> list[tuple[str, str]]:
    out = []
    for i, m in enumerate(merges):
        pair = tuple(m.split(" "))
        if len(pair) != 2:
            raise TokenizerError(f"{meta.file}: metadata key 'tokenizer.ggml.merges' entry {i} ({m!r}) is not "
                                 "two tokens separated by one space")
        out.append(pair)
    return out


def _build_bpe(meta: _Metadata, vocab: dict[str, int], merges: list[tuple[str, str]], **options) -> _HFTokenizer:
    try:
        return _HFTokenizer(BPE(vocab=vocab, merges=merges, dropout=None, **options))
    except Exception as e:  # a merge naming a token the vocabulary lacks
        raise TokenizerError(f"{meta.file}: metadata keys 'tokenizer.ggml.tokens'/'tokenizer.ggml.merges' do "
                             f"not form a BPE model ({_one_line(e)})") from e


def _byte_level(meta: _Metadata, tokens: list[str], merges: Optional[list[str]]):
    """GPT-2-style byte-level BPE; also returns the 'spelled in the byte alphabet' test for control tokens."""
    if merges is None:
        raise TokenizerError(f"{meta.file}: metadata key 'tokenizer.ggml.merges' is missing "
                             "(a gpt2 tokenizer needs its BPE merges)")
    table = _byte_alphabet()
    alphabet = set(table.values())

    def in_alphabet(token: str) -> bool:
        return set(token) <= alphabet

    # a token written with other characters (a raw space, say) is respelled byte by byte, as transformers does
    vocab = {t if in_alphabet(t) else "".join(table[b] for b in t.encode("utf-8")): i for i, t in enumerate(tokens)}
    tok = _build_bpe(meta, vocab, _parse_merges(meta, merges), continuing_subword_prefix="",
                     end_of_word_suffix="", fuse_unk=False)
    split = PRE_TOKENIZER_SPLITS.get(meta.get("tokenizer.ggml.pre", "str"))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                              use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok, in_alphabet


def _sentencepiece(meta: _Metadata, tokens: list[str], merges: Optional[list[str]],
                   scores: Optional[list[float]], arch: str) -> _HFTokenizer:
    """SentencePiece-style BPE over `▁`-spelled pieces with <0xNN> byte fallback."""
    vocab = {t: i for i, t in enumerate(tokens)}
    if merges is not None:
        pairs = _parse_merges(meta, merges)
    elif scores is not None:
        pairs = merges_from_scores(tokens, scores)
    else:
        raise TokenizerError(f"{meta.file}: metadata keys 'tokenizer.ggml.merges' and 'tokenizer.ggml.scores' "
                             "are both missing (a llama tokenizer needs one)")
    tok = _build_bpe(meta, vocab, pairs, fuse_unk=True, byte_fallback=True)
    prefix = meta.get("tokenizer.ggml.add_space_prefix", "bool") is not False
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if arch == "phi3":   # transformers: the prefix comes from a normalizer, every space becomes ▁
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.pre_tokenizer = None
        prefix = True
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first" if prefix else "never",
                                                     split=False)
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(content=" ", left=1)] if prefix else []))
    return tok


def merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a token into two vocabulary tokens,
    best score first (ties: longer left part, then longer right part, then vocabulary order)."""
    index = {t: i for i, t in enumerate(tokens)}
    score_of = dict(zip(tokens, scores))
    found: list[tuple[str, str, float]] = []
    for token, score in score_of.items():
        splits = [(token[:k], token[k:]) for k in range(1, len(token))
                  if token[:k] in index and token[k:] in index]
        splits.sort(key=lambda lr: (index[lr[0]], index[lr[1]]))
        found += [(left, right, score) for left, right in splits]
    found.sort(key=lambda m: (-m[2], -len(m[0]), -len(m[1])))
    return [(left, right) for left, right, _ in found]


def _post_processor(backend: _HFTokenizer, bos: Optional[str], eos: Optional[str]):
    """TemplateProcessing adding BOS and/or EOS around each sequence (nothing when both are None)."""
    def around(seq: str, type_id: int) -> list[str]:
        return ([f"{bos}:{type_id}"] if bos else []) + [f"${seq}:{type_id}"] + ([f"{eos}:{type_id}"] if eos else [])
    specials = [(t, backend.token_to_id(t)) for t in dict.fromkeys(x for x in (bos, eos) if x)]
    return processors.TemplateProcessing(single=around("A", 0), pair=around("A", 0) + around("B", 1),
                                         special_tokens=specials)
