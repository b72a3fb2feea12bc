"""The engine's Tokenizer, whatever the model's format: HF `tokenizers`, chat templates rendered with jinja2.
An HF directory loads through Tokenizer.from_dir, a GGUF file through gguf_tokenizer.py; tokenizer.py picks.

Behaviour follows transformers' fast tokenizer (`PreTrainedTokenizerFast` / `AutoTokenizer`) so that the
token ids and rendered chats the engine sees are the ones a user gets from transformers, without
importing transformers:

- named special tokens from tokenizer_config.json are registered as special added tokens;
- tokenizer.json's post-processor alone decides which special tokens encode() adds (transformers 5 drops
  tokenizer_config's add_bos_token/add_eos_token when tokenizer.json exists);
- chat templates render in a sandboxed, immutable jinja2 environment with trim_blocks/lstrip_blocks,
  `raise_exception`, `strftime_now`, a non-HTML-escaping `tojson`, and the special tokens as variables.
"""
from __future__ import annotations

import os
from typing import Any, Optional

from tokenizers import AddedToken
from tokenizers import Tokenizer as _HFTokenizer

from batchrun.chat_template import TokenizerError, compile_template, normalize_messages, plain  # noqa: F401
from batchrun.tokenizer_files import added_token, ids_of, read_json, read_text

# transformers' named special-token attributes, in its order (also the template variables they become)
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _clean_up_spaces(text: str) -> str:
    # transformers' clean_up_tokenization (meant for WordPiece-style outputs)
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                 (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text


class Tokenizer:
    """tokenizer.json + tokenizer_config.json + chat template, as transformers would load them.

    `vocab_size` counts added tokens (transformers' `len(tokenizer)`). `add_bos_token` is whether
    encode(add_special_tokens=True) prepends BOS, as the tokenizer.json post-processor decides.
    Encoding/decoding methods are thread-safe.
    """

    def __init__(self, tokenizer: _HFTokenizer, config: Optional[dict] = None, *, path: str = "<memory>",
                 chat_template: Any = None, chat_template_source: str = "chat template",
                 extra_eos_token_ids: Optional[list[int]] = None):
        config = dict(config or {})
        where = os.path.join(path, "tokenizer_config.json")
        self.path = path
        self._tok = tokenizer

        named: dict[str, AddedToken] = {}
        for name in SPECIAL_TOKEN_NAMES:
            t = added_token(config.get(name), f"{where} key {name!r}")
            if t is not None:
                named[name] = t
        extra = config.get("extra_special_tokens", config.get("additional_special_tokens")) or []
        if isinstance(extra, dict):   # v5 also allows {"name": token}
            extra = list(extra.values())
        if not isinstance(extra, list):
            raise TokenizerError(f"{where} key 'additional_special_tokens': expected a list, got {extra!r}")
        extra_tokens = [added_token(t, f"{where} key 'additional_special_tokens'") for t in extra]
        # transformers registers every named special token as a special added token (adding it if absent)
        to_add = list(named.values()) + [t for t in extra_tokens if t is not None]
        if to_add:
            self._tok.add_special_tokens(to_add)

        self.bos_token: Optional[str] = named["bos_token"].content if "bos_token" in named else None
        self.eos_token: Optional[str] = named["eos_token"].content if "eos_token" in named else None
        self.pad_token: Optional[str] = named["pad_token"].content if "pad_token" in named else None
        self._special_map = {name: t.content for name, t in named.items()}
        self.bos_token_id: Optional[int] = self.token_to_id(self.bos_token)
        self.eos_token_id: Optional[int] = self.token_to_id(self.eos_token)
        self.pad_token_id: Optional[int] = self.token_to_id(self.pad_token)

        # transformers' from_pretrained ignores add_bos_token/add_eos_token when tokenizer.json exists: the
        # post-processor decides. add_bos_token reports what it does, so callers can avoid a double BOS.
        self.add_bos_token: bool = bool(self.bos_token_id is not None
                                        and self._tok.encode("", add_special_tokens=True).ids[:1]
                                        == [self.bos_token_id])

        eos: list[int] = []
        for i in list(extra_eos_token_ids or []) + ([self.eos_token_id] if self.eos_token_id is not None else []):
            if i not in eos:
                eos.append(i)
        self.eos_token_ids: list[int] = eos

        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        self._is_bpe = type(self._tok.model).__name__ == "BPE"
        self.model_max_length = config.get("model_max_length")

        if chat_template is None:
            chat_template = config.get("chat_template")
        self._templates = self._parse_templates(chat_template, chat_template_source)
        self._template_source = chat_template_source
        self.chat_template: Optional[str] = self._templates.get("default")

    # -- loading -----------------------------------------------------------------------------
    @classmethod
    def from_dir(cls, path: str) -> "Tokenizer":
        """Load from an HF model directory: tokenizer.json (required), tokenizer_config.json,
        chat_template.jinja (wins over tokenizer_config's chat_template), generation_config.json and
        config.json (their eos_token_id join the EOS set)."""
        path = os.fspath(path)
        if not os.path.isdir(path):
            raise TokenizerError(f"tokenizer path {path!r} is not a directory")
        tok_file = os.path.join(path, "tokenizer.json")
        if not os.path.exists(tok_file):
            raise TokenizerError(f"{tok_file}: missing (batchrun needs a fast tokenizer's tokenizer.json)")
        try:
            tok = _HFTokenizer.from_file(tok_file)
        except Exception as e:  # tokenizers raises a bare Exception on bad files
            raise TokenizerError(f"{tok_file}: cannot load ({e})") from e
        cfg_file = os.path.join(path, "tokenizer_config.json")
        config = read_json(cfg_file) or {}

        template: Any = None
        source = cfg_file
        jinja_file = os.path.join(path, "chat_template.jinja")
        extra_dir = os.path.join(path, "additional_chat_templates")
        if os.path.exists(jinja_file) or os.path.isdir(extra_dir):
            template = {}
            cfg_t = config.get("chat_template")
            if isinstance(cfg_t, str):
                template["default"] = cfg_t
            elif isinstance(cfg_t, list):
                template.update(cls._parse_templates(cfg_t, cfg_file))
            if os.path.isdir(extra_dir):
                for name in sorted(os.listdir(extra_dir)):
                    if name.endswith(".jinja"):
                        template[name[: -len(".jinja")]] = read_text(os.path.join(extra_dir, name))
            if os.path.exists(jinja_file):
                template["default"] = read_text(jinja_file)
                source = jinja_file

        eos: list[int] = []
        for name in ("generation_config.json", "config.json"):
            f = os.path.join(path, name)
            data = read_json(f) or {}
            eos += ids_of(data.get("eos_token_id"), f"{f} key 'eos_token_id'")
        return cls(tok, config, path=path, chat_template=template, chat_template_source=source,
                   extra_eos_token_ids=eos)

    @staticmethod
    def _parse_templates(value: Any, source: str) -> dict[str, str]:
        if value is None:
            return {}
        if isinstance(value, str):
            return {"default": value}
        if isinstance(value, dict) and all(isinstance(v, str) for v in value.values()):
            return dict(value)
        if isinstance(value, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                           and isinstance(t.get("template"), str) for t in value):
            return {t["name"]: t["template"] for t in value}
        raise TokenizerError(f"{source}: chat_template must be a string or a list of "
                             f"{{'name': ..., 'template': ...}} objects")

    # -- vocabulary --------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Vocabulary size including added tokens (transformers' len(tokenizer))."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    def token_to_id(self, token: Optional[str]) -> Optional[int]:
        return None if token is None else self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> Optional[str]:
        return self._tok.id_to_token(token_id)

    @property
    def backend(self) -> _HFTokenizer:
        """The underlying `tokenizers.Tokenizer`."""
        return self._tok

    # -- encode / decode ---------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with add_special_tokens the post-processor adds BOS/EOS as configured."""
        if not isinstance(text, str):
            raise TokenizerError(f"encode() needs a str, got {type(text).__name__}")
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """encode() over many texts, in parallel in Rust."""
        texts = list(texts)
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise TokenizerError(f"encode_batch(): text {i} is a {type(t).__name__}, not a str")
        if not texts:
            return []
        return [e.ids for e in self._tok.encode_batch_fast(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids` (byte-level BPE bytes are merged back by the tokenizer's decoder)."""
        text = self._tok.decode(_as_ints(ids), skip_special_tokens=skip_special_tokens)
        return self._cleanup(text)

    def decode_batch(self, ids: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        """decode() over many sequences, in parallel in Rust."""
        seqs = [_as_ints(x) for x in ids]
        if not seqs:
            return []
        return [self._cleanup(t) for t in self._tok.decode_batch(seqs, skip_special_tokens=skip_special_tokens)]

    def _cleanup(self, text: str) -> str:
        # transformers never applies this to BPE models (it would delete real spaces before punctuation)
        if self.clean_up_tokenization_spaces and not self._is_bpe:
            return _clean_up_spaces(text)
        return text

    # -- chat --------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render one conversation to text, as transformers' apply_chat_template(tokenize=False).

        Template variables: messages, add_generation_prompt, tools, documents, the special tokens
        (bos_token, eos_token, ...) and every keyword argument (which override the special tokens).
        Raises TokenizerError when there is no template or the template fails on this conversation.
        """
        tools = kwargs.pop("tools", None)
        documents = kwargs.pop("documents", None)
        template = self._select_template(tools)
        msgs = normalize_messages(messages)
        if tools is not None:
            if not isinstance(tools, (list, tuple)) or not all(isinstance(t, dict) for t in tools):
                raise TokenizerError("tools must be a list of JSON-schema dicts")
            tools = plain(list(tools))
        if documents is not None:
            if not isinstance(documents, (list, tuple)) or not all(isinstance(d, dict) for d in documents):
                raise TokenizerError("documents must be a list of dicts with 'title' and 'text'")
            documents = plain(list(documents))
        variables = {**self._special_map, **plain(kwargs)}
        compiled = self._compiled(template)
        import jinja2
        try:
            return compiled.render(messages=msgs, tools=tools, documents=documents,
                                   add_generation_prompt=bool(add_generation_prompt), **variables)
        except jinja2.exceptions.TemplateError as e:
            raise TokenizerError(f"chat template ({self._template_source}) failed: {e}") from e
        except Exception as e:  # a template bug on this row (e.g. adding str and int) is a row error too
            raise TokenizerError(f"chat template ({self._template_source}) failed: "
                                 f"{type(e).__name__}: {e}") from e

    def encode_chat_batch(self, conversations: list[list[dict]], add_generation_prompt: bool = True) -> list[list[int]]:
        """Render every conversation, then encode without special tokens (the template carries BOS).

        A conversation the template rejects raises TokenizerError naming its index; callers that need
        per-row errors render rows with apply_chat_template themselves.
        """
        texts = []
        for i, conv in enumerate(conversations):
            try:
                texts.append(self.apply_chat_template(conv, add_generation_prompt=add_generation_prompt))
            except TokenizerError as e:
                raise TokenizerError(f"conversation {i}: {e}") from e
        return self.encode_batch(texts, add_special_tokens=False)

    def _select_template(self, tools: Any) -> str:
        if not self._templates:
            raise TokenizerError(f"{self.path}: the model has no chat template (no chat_template in "
                                 "tokenizer_config.json and no chat_template.jinja); use plain prompts "
                                 "or supply a template")
        if tools is not None and "tool_use" in self._templates:
            return self._templates["tool_use"]
        if "default" in self._templates:
            return self._templates["default"]
        raise TokenizerError(f"{self._template_source}: several chat templates "
                             f"({', '.join(sorted(self._templates))}) and none named 'default'")

    def _compiled(self, template: str):
        import jinja2
        try:
            return compile_template(template)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise TokenizerError(f"{self._template_source}: chat template does not parse: "
                                 f"{e.message} (line {e.lineno})") from e

    def __repr__(self) -> str:
        return (f"Tokenizer(path={self.path!r}, vocab_size={self.vocab_size}, bos={self.bos_token!r}, "
                f"eos={self.eos_token!r}, eos_token_ids={self.eos_token_ids}, chat_template="
                f"{'yes' if self.chat_template else 'no'})")


def _as_ints(ids: Any) -> list[int]:
    if isinstance(ids, list):
        return ids
    if hasattr(ids, "tolist"):   # numpy arrays, torch tensors
        return ids.tolist()
    return list(ids)
