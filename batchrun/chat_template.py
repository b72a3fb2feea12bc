"""Chat templates: a sandboxed, immutable jinja2 environment that renders like transformers' (trim_blocks,
lstrip_blocks, `raise_exception`, `strftime_now`, a non-HTML-escaping `tojson`, `{% generation %}`), and
the messages it sees copied into plain JSON-like values."""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any, Optional

_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


class TokenizerError(ValueError):
    """A tokenizer directory, file or chat template that cannot be used; the message names it."""


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
def compile_template(source: str):
    """Compile a template once per distinct source string (thread-safe: jinja templates are reentrant)."""
    return _environment().from_string(source)


def plain(value: Any) -> Any:
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
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain(v) for v in value)
    if hasattr(value, "item") and callable(value.item) and getattr(value, "shape", None) == ():
        return plain(value.item())   # numpy / torch scalars
    if callable(getattr(value, "model_dump", None)):
        return plain(value.model_dump())
    return f"<{type(value).__name__}>"


def normalize_messages(messages: Any) -> list[dict]:
    if not isinstance(messages, (list, tuple)):
        raise TokenizerError(f"a conversation must be a list of message dicts, got {type(messages).__name__}")
    if len(messages) == 0:
        raise TokenizerError("cannot apply a chat template to an empty conversation")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise TokenizerError(f"message {i} is a {type(m).__name__}, not a dict with 'role' and 'content'")
        # like transformers: a key set to None counts as absent (templates test `'x' in message`)
        m = {k: plain(v) for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_KEYS if m.get(k) is not None), None)
        if reasoning is not None:   # templates read reasoning under different names
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out
