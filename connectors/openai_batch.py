"""OpenAI Batch API input files: JSONL lines {custom_id, method, url, body} for /v1/chat/completions.

Each line becomes one row: `custom_id` (the id), `method`, `url`, `model` (body.model, informative
only), `messages` (list<struct<role, content>>, rendered with the model's chat template) and
ROW_SAMPLING, the body's sampling keys as a JSON object that overrides the job's sampling section for
that row. A line that is not a valid request (bad JSON, missing custom_id, an unsupported url, a body
key batchrun cannot honour) is an error row naming the file, the line and the key; the job goes on.

Body keys:
    honoured: messages, max_tokens / max_completion_tokens, temperature, top_p, stop, seed, n (one output
              row per sample, `choices` with n entries), presence_penalty, frequency_penalty, logit_bias
              ({"token id": bias}), logprobs + top_logprobs (<= 20; OpenAI's `logprobs.content` in the
              output, from the raw distribution), response_format json_schema (its json_schema.schema:
              structured_outputs json) / json_object / text, and vLLM's extensions top_k, min_p, ignore_eos,
              stop_token_ids, include_stop_str_in_output, repetition_penalty, min_tokens, bad_words
    ignored:  keys that do not change the generated text: model (the job's model answers), user,
              metadata, store, service_tier, stream: false, stream_options, parallel_tool_calls,
              and the neutral value of any key below
    refused (error row): any other key, or a non-neutral value of tools, tool_choice other than "none", stream: true,
              skip_special_tokens: false; top_logprobs without logprobs: true
"""
from __future__ import annotations

import json
from typing import Any, Optional

import pyarrow as pa

from batchrun.connectors.base import InputError, Unit
from batchrun.connectors.lines import ROW_ERROR, JsonlSource, with_row_errors
from batchrun.outputs import MAX_LOGPROBS

ROW_SAMPLING = "_batchrun_sampling"      # per-row SamplingParams overrides (JSON object), null = none
_REQUEST_ERROR = "_batchrun_request_error"
CHAT_URL = "/v1/chat/completions"

SCHEMA = pa.schema([
    ("custom_id", pa.string()), ("method", pa.string()), ("url", pa.string()), ("model", pa.string()),
    ("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
    (ROW_SAMPLING, pa.string()), (_REQUEST_ERROR, pa.string()),
])

# body key -> (SamplingParams field, accepted Python types)
_NUM = (int, float)
SAMPLING_KEYS: dict[str, tuple[str, tuple]] = {
    "max_tokens": ("max_tokens", (int,)), "max_completion_tokens": ("max_tokens", (int,)),
    "temperature": ("temperature", _NUM), "top_p": ("top_p", _NUM), "seed": ("seed", (int,)),
    "top_k": ("top_k", (int,)), "min_p": ("min_p", _NUM), "ignore_eos": ("ignore_eos", (bool,)),
    "stop_token_ids": ("stop_token_ids", (list,)),
    "include_stop_str_in_output": ("include_stop_str_in_output", (bool,)),
    "n": ("n", (int,)), "presence_penalty": ("presence_penalty", _NUM),
    "frequency_penalty": ("frequency_penalty", _NUM), "logit_bias": ("logit_bias", (dict,)),
    "repetition_penalty": ("repetition_penalty", _NUM), "min_tokens": ("min_tokens", (int,)),
    "bad_words": ("bad_words", (list,)),
}
LOGPROB_KEYS = ("logprobs", "top_logprobs")       # OpenAI's pair -> SamplingParams.logprobs
IGNORED_KEYS = {"model", "user", "metadata", "store", "service_tier", "stream_options", "parallel_tool_calls"}
# key -> the values that change nothing (accepted and ignored); any other value is refused
NEUTRAL: dict[str, tuple] = {
    "stream": (False,),
    "tools": ([],), "tool_choice": ("none",), "skip_special_tokens": (True,),
}
SUPPORTED = sorted({"messages", "stop", "response_format", *SAMPLING_KEYS, *LOGPROB_KEYS, *IGNORED_KEYS, *NEUTRAL})


class _Invalid(Exception):
    pass


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, or the text parts of a content array joined by newlines."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):
        parts = []
        for j, p in enumerate(content):
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                kind = p.get("type") if isinstance(p, dict) else type(p).__name__
                raise _Invalid(f"{where}.content[{j}]: only text parts are supported, found {kind!r}")
            parts.append(p["text"])
        return "\n".join(parts)
    raise _Invalid(f"{where}.content: expected a string or a list of text parts")


def _messages(value: Any) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise _Invalid("body.messages: a non-empty list of {role, content} objects is required")
    out = []
    for i, m in enumerate(value):
        where = f"body.messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _Invalid(f"{where}: an object with a string role is required")
        if m.get("tool_calls") or m.get("function_call"):
            raise _Invalid(f"{where}: tool calls are not supported")
        role = "system" if m["role"] == "developer" else m["role"]   # OpenAI's newer name for system
        out.append({"role": role, "content": _text(m.get("content"), where)})
    return out


def _sampling(body: dict) -> dict:
    """The body's sampling keys as SamplingParams overrides; raises _Invalid naming the first bad key."""
    over: dict[str, Any] = {}
    for key, value in body.items():
        if key in ("messages",) or key in IGNORED_KEYS or key in LOGPROB_KEYS:
            continue
        if key == "response_format":
            so = _response_format(value)
            if so is not None:
                over["structured_outputs"] = so
            continue
        if key in NEUTRAL:
            if value is not None and value not in NEUTRAL[key]:
                raise _Invalid(f"body.{key}={json.dumps(value)}: not supported by batchrun "
                               f"(only {json.dumps(NEUTRAL[key][0])})")
            continue
        if key == "stop":
            if value is None:
                continue
            if isinstance(value, str):
                value = [value]
            if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
                raise _Invalid("body.stop: a string or a list of strings is required")
            over["stop"] = value
            continue
        if key not in SAMPLING_KEYS:
            raise _Invalid(f"body.{key}: unsupported key (batchrun honours {', '.join(SUPPORTED)})")
        field, types = SAMPLING_KEYS[key]
        if value is None:
            continue
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise _Invalid(f"body.{key}: expected {' or '.join(t.__name__ for t in types)}, "
                           f"found {type(value).__name__}")
        if key == "stop_token_ids" and not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            raise _Invalid("body.stop_token_ids: a list of integers is required")
        if field in over:
            raise _Invalid(f"body.{key}: max_tokens and max_completion_tokens are both set")
        over[field] = value
    k = _logprobs(body.get("logprobs"), body.get("top_logprobs"))
    if k is not None:
        over["logprobs"] = k
    return over


def _response_format(value: Any) -> Optional[dict]:
    """OpenAI's response_format -> SamplingParams.structured_outputs (None: free text)."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        js = value.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
            raise _Invalid("body.response_format.json_schema.schema: a JSON schema object is required")
        return {"json": js["schema"]}
    raise _Invalid(f"body.response_format={json.dumps(value)}: expected type text, json_object or json_schema")


def _logprobs(on: Any, top: Any) -> Optional[int]:
    """OpenAI's logprobs (bool) and top_logprobs (int) -> SamplingParams.logprobs (None: off)."""
    if on is not None and not isinstance(on, bool):
        raise _Invalid(f"body.logprobs: expected bool, found {type(on).__name__}")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int)):
        raise _Invalid(f"body.top_logprobs: expected int, found {type(top).__name__}")
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise _Invalid(f"body.top_logprobs={top}: must be in [0, {MAX_LOGPROBS}]")
    if top and not on:
        raise _Invalid("body.top_logprobs: needs body.logprobs: true")
    return (top or 0) if on else None


def parse_request(obj: dict) -> dict:
    """One Batch API request line (already a JSON object) -> a row of SCHEMA (error in _REQUEST_ERROR)."""
    cid = obj.get("custom_id")
    row: dict[str, Any] = {"custom_id": cid if isinstance(cid, str) else None, "method": obj.get("method"),
                           "url": obj.get("url"), "model": None, "messages": None, ROW_SAMPLING: None,
                           _REQUEST_ERROR: None}
    for k in ("method", "url"):
        if not isinstance(row[k], (str, type(None))):
            row[k] = json.dumps(row[k])
    try:
        if not isinstance(cid, str) or not cid:
            raise _Invalid("custom_id: a non-empty string is required")
        if (obj.get("method") or "POST").upper() != "POST":
            raise _Invalid(f"method {obj.get('method')!r}: only POST is supported")
        if obj.get("url") != CHAT_URL:
            raise _Invalid(f"url {obj.get('url')!r}: only {CHAT_URL} is supported")
        body = obj.get("body")
        if not isinstance(body, dict):
            raise _Invalid("body: an object is required")
        if isinstance(body.get("model"), str):
            row["model"] = body["model"]
        row["messages"] = _messages(body.get("messages"))
        over = _sampling(body)
        row[ROW_SAMPLING] = json.dumps(over, sort_keys=True) if over else None
    except _Invalid as e:
        row["messages"], row[ROW_SAMPLING] = None, None
        row[_REQUEST_ERROR] = str(e) if cid is None or not isinstance(cid, str) \
            else f"custom_id {cid!r}: {e}"
    return row


class OpenAIBatchSource(JsonlSource):
    """OpenAI Batch API input (.jsonl): units, byte offsets and bad-line handling as for JSONL."""

    def _schema_of(self, path: str) -> pa.Schema:
        self._requests_seen = 0
        super()._schema_of(path)
        if not self._requests_seen:
            raise InputError(f"{self.name(path)}: not an OpenAI Batch input file: none of its first lines "
                             "has custom_id and body ({\"custom_id\": ..., \"method\": \"POST\", \"url\": "
                             f"\"{CHAT_URL}\", \"body\": {{\"messages\": [...]}}}})")
        return SCHEMA

    def _decode(self, path: str, lineno: int, line: bytes) -> tuple[Any, Optional[str]]:
        obj, err = super()._decode(path, lineno, line)
        if obj is None:
            return None, err
        if "custom_id" in obj and "body" in obj:
            self._requests_seen = getattr(self, "_requests_seen", 0) + 1
        row = parse_request(obj)
        if row[_REQUEST_ERROR] is not None:
            row[_REQUEST_ERROR] = f"{self.name(path)}: line {lineno}: {row[_REQUEST_ERROR]}"
        return row, None

    def _objects_table(self, objs: list[dict]) -> pa.Table:
        return pa.Table.from_pylist(objs, schema=SCHEMA)

    def read(self, unit: Unit, columns: Optional[list[str]] = None) -> pa.Table:
        """Rows of `unit`: `columns` plus ROW_SAMPLING, and ROW_ERROR when a line is not a valid request."""
        t = super().read(unit, None)
        errors = t.column(ROW_ERROR).to_pylist() if ROW_ERROR in t.column_names else [None] * t.num_rows
        errors = [e if e is not None else r for e, r in zip(errors, t.column(_REQUEST_ERROR).to_pylist())]
        cols = [c for c in (columns if columns is not None else SCHEMA.names[:5]) if c != ROW_SAMPLING]
        missing = [c for c in cols if c not in SCHEMA.names]
        if missing:
            raise InputError(f"{self.name(unit.path)}: no column {missing[0]!r} in an OpenAI Batch file "
                             f"(columns: {', '.join(SCHEMA.names[:5])})")
        return with_row_errors(t.select([*cols, ROW_SAMPLING]), errors)
