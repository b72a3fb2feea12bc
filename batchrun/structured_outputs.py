"""StructuredOutputsParams: what a request's output must match, in vLLM's shape (exactly one of json,
json_object, regex, choice, grammar), checked and turned into an llguidance grammar without a tokenizer.

The grammar library is llguidance (README "Structured outputs" gives the measurements behind the choice);
engine/structured.py compiles it against the tokenizer and masks the logits.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional, Union

KINDS = ("json", "json_object", "regex", "choice", "grammar")
# JSON is generated compactly ({"a":1,"b":[2]}): free whitespace lets an unsure model pad forever
JSON_OPTIONS = {"whitespace_flexible": False}


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


@dataclass
class StructuredOutputsParams:
    """Constrain a request's output (vLLM's names; set exactly one):

    json: a JSON schema (a dict, or its JSON text); the output is one JSON value valid against it.
    json_object: True -> any JSON object.
    regex: the output matches this regular expression (Rust regex syntax, no look-around).
    choice: the output is exactly one of these strings.
    grammar: a context-free grammar in Lark syntax or llama.cpp's GBNF (EBNF), start rule `start` / `root`.

    Invalid specs raise ValueError naming the key (`structured_outputs.regex: ...`).
    """
    json: Union[dict, str, None] = None
    json_object: Optional[bool] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None

    def __post_init__(self) -> None:
        set_ = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise ValueError("structured_outputs: set exactly one of json, json_object, regex, choice, grammar"
                             + (f" (got {', '.join(set_)})" if set_ else ""))
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs.json: not valid JSON ({e})") from None
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise ValueError(f"structured_outputs.json: a JSON schema is an object, got {type(self.json).__name__}")
        if self.json_object not in (None, True, False):
            raise ValueError(f"structured_outputs.json_object: expected true, got {self.json_object!r}")
        for key in ("regex", "grammar"):
            v = getattr(self, key)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"structured_outputs.{key}: expected a non-empty string, got {v!r}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)) or not self.choice:
                raise ValueError("structured_outputs.choice: expected a non-empty list of strings, "
                                 f"got {self.choice!r}")
            if not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("structured_outputs.choice: every choice must be a non-empty string")
            self.choice = list(self.choice)
        problem = _validate(self.grammar_text())
        if problem:
            raise ValueError(f"structured_outputs.{self.kind}: {problem}")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> str:
        """Canonical text of the spec: the compile cache's key."""
        return json.dumps({self.kind: getattr(self, self.kind)}, sort_keys=True)

    def grammar_text(self) -> str:
        """The llguidance grammar for this spec (raises ValueError naming the key on a grammar that does
        not convert)."""
        import llguidance
        M = llguidance.LLMatcher
        kind = self.kind
        try:
            if kind == "json":
                return M.grammar_from_json_schema(self.json, defaults=JSON_OPTIONS)
            if kind == "json_object":
                return M.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
            if kind == "regex":
                return M.grammar_from_regex(self.regex)
            if kind == "choice":
                return llguidance.grammar_from("choice", self.choice)
            return llguidance.grammar_from("grammar", self.grammar)   # Lark as is, GBNF converted
        except (ValueError, TypeError) as e:
            raise ValueError(f"structured_outputs.{kind}: {_one_line(e)}") from None


def _validate(grammar: str) -> str:
    import llguidance
    return _one_line(llguidance.LLMatcher.validate_grammar(grammar))


def as_params(value: Any, where: str = "structured_outputs") -> Optional[StructuredOutputsParams]:
    """A StructuredOutputsParams from itself, a dict of its keys, or None; ValueError naming `where`."""
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected a mapping with one of {', '.join(KINDS)}, got {value!r}")
    unknown = sorted(set(value) - set(KINDS))
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(KINDS)})")
    try:
        return StructuredOutputsParams(**value)
    except ValueError as e:
        raise ValueError(str(e).replace("structured_outputs", where, 1)) from None
