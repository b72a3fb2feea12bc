"""The engine's tokenizer: HF `tokenizers` over tokenizer.json, chat templates rendered with jinja2.

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

import json
import os
from datetime import datetime
from functools import lru_cache
from typing import Any, Optional

from tokenizers import AddedToken
from tokenizers import Tokenizer as _HFTokenizer

# transformers' named special-token attributes, in its order (also the template variables they become)
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


class TokenizerError(ValueError):
    """A tokenizer directory, file or chat template that cannot be used; the message names it."""


# -- chat templates ----------------------------------------------------------------------------------

def _raise_exception(message: str):
    import jinja2
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Optional[int] = None, separators=None,
            sort_keys: bool = False) -> str:
    # jinja's own tojson HTML-escapes <, >, & and ' which chat templates must not do
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=1)
def _environment():
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` (used by training templates) renders its body unchanged."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class SafeNamespace(jinja2.utils.Namespace):
        """namespace() that refuses underscore names, so templates cannot reach interpreter internals."""

        def __init__(*args, **kwargs):  # noqa: N805 - same trick as jinja's Namespace, allows namespace(self=...)
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for key in attrs:
                SafeNamespace._check(key)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, key, value):
            SafeNamespace._check(key)
            jinja2.utils.Namespace.__setitem__(self, key, value)

        @staticmethod
        def _check(key):
            if isinstance(key, str) and key.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"chat templates cannot set namespace attribute {key!r}")

    class DictFactory:
        """`dict(...)` for templates, without exposing the dict type itself."""

        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = DictFactory()
    env.globals["namespace"] = SafeNamespace
    return env


@lru_cache(maxsize=64)
def _compile(source: str):
    """Compile a template once per distinct source string (thread-safe: jinja templates are reentrant)."""
    return _environment().from_string(source)


def _plain(value: Any) -> Any:
    """Copy `value` into plain JSON-like types; anything else becomes an inert '<TypeName>' placeholder.

    The sandbox then only ever sees str/int/float/bool/None/dict/list/tuple, never objects with methods.
    """
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if hasattr(value, "item") and callable(value.item) and getattr(value, "shape", None) == ():
        return _plain(value.item())   # numpy / torch scalars
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _normalize_messages(messages: Any) -> list[dict]:
    if not isinstance(messages, (list, tuple)):
        raise TokenizerError(f"a conversation must be a list of message dicts, got {type(messages).__name__}")
    if len(messages) == 0:
        raise TokenizerError("cannot apply a chat template to an empty conversation")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise TokenizerError(f"message {i} is a {type(m).__name__}, not a dict with 'role' and 'content'")
        # like transformers: a key set to None counts as absent (templates test `'x' in message`)
        m = {k: _plain(v) for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_KEYS if m.get(k) is not None), None)
        if reasoning is not None:   # templates read reasoning under different names
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


# -- config reading ----------------------------------------------------------------------------------

def _read_json(path: str, required: bool = False) -> Optional[dict]:
    if not os.path.exists(path):
        if required:
            raise TokenizerError(f"{path}: missing")
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"{path}: cannot read ({e})") from e
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _added_token(value: Any, where: str) -> Optional[AddedToken]:
    """tokenizer_config special token: a string or an AddedToken dict ({"content": ..., "lstrip": ...})."""
    if value is None:
        return None
    if isinstance(value, str):
        return AddedToken(value, special=True, normalized=False)
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return AddedToken(value["content"], single_word=bool(value.get("single_word", False)),
                          lstrip=bool(value.get("lstrip", False)), rstrip=bool(value.get("rstrip", False)),
                          normalized=bool(value.get("normalized", False)), special=True)
    raise TokenizerError(f"{where}: expected a string or an AddedToken object with 'content', got {value!r}")


def _ids(value: Any, where: str) -> list[int]:
    if value is None:
        return []
    if isinstance(value, bool) or not isinstance(value, (int, list)):
        raise TokenizerError(f"{where}: expected an int or a list of ints, got {value!r}")
    values = value if isinstance(value, list) else [value]
    if any(isinstance(v, bool) or not isinstance(v, int) for v in values):
        raise TokenizerError(f"{where}: expected an int or a list of ints, got {value!r}")
    return values


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
            t = _added_token(config.get(name), f"{where} key {name!r}")
            if t is not None:
                named[name] = t
        extra = config.get("extra_special_tokens", config.get("additional_special_tokens")) or []
        if isinstance(extra, dict):   # v5 also allows {"name": token}
            extra = list(extra.values())
        if not isinstance(extra, list):
            raise TokenizerError(f"{where} key 'additional_special_tokens': expected a list, got {extra!r}")
        extra_tokens = [_added_token(t, f"{where} key 'additional_special_tokens'") for t in extra]
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
        config = _read_json(cfg_file) or {}

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
                        template[name[: -len(".jinja")]] = _read_text(os.path.join(extra_dir, name))
            if os.path.exists(jinja_file):
                template["default"] = _read_text(jinja_file)
                source = jinja_file

        eos: list[int] = []
        for name in ("generation_config.json", "config.json"):
            f = os.path.join(path, name)
            data = _read_json(f) or {}
            eos += _ids(data.get("eos_token_id"), f"{f} key 'eos_token_id'")
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
        msgs = _normalize_messages(messages)
        if tools is not None:
            if not isinstance(tools, (list, tuple)) or not all(isinstance(t, dict) for t in tools):
                raise TokenizerError("tools must be a list of JSON-schema dicts")
            tools = _plain(list(tools))
        if documents is not None:
            if not isinstance(documents, (list, tuple)) or not all(isinstance(d, dict) for d in documents):
                raise TokenizerError("documents must be a list of dicts with 'title' and 'text'")
            documents = _plain(list(documents))
        variables = {**self._special_map, **_plain(kwargs)}
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
            return _compile(template)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise TokenizerError(f"{self._template_source}: chat template does not parse: "
                                 f"{e.message} (line {e.lineno})") from e

    def __repr__(self) -> str:
        return (f"Tokenizer(path={self.path!r}, vocab_size={self.vocab_size}, bos={self.bos_token!r}, "
                f"eos={self.eos_token!r}, eos_token_ids={self.eos_token_ids}, chat_template="
                f"{'yes' if self.chat_template else 'no'})")


def load_tokenizer(path: str) -> Tokenizer:
    """The tokenizer of a model path: an HF directory (Tokenizer.from_dir) or a GGUF file's metadata."""
    from batchrun.models.loader import find_gguf
    gguf_file = find_gguf(path)
    if gguf_file is not None:
        from batchrun.gguf_tokenizer import tokenizer_from_gguf
        return tokenizer_from_gguf(gguf_file)
    return Tokenizer.from_dir(path)


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{path}: cannot read ({e})") from e


def _as_ints(ids: Any) -> list[int]:
    if isinstance(ids, list):
        return ids
    if hasattr(ids, "tolist"):   # numpy arrays, torch tensors
        return ids.tolist()
    return list(ids)
