"""Prompt rendering: one unit's rows -> prompt text and token ids (template, chat template, per-row sampling).

A row that cannot be rendered gets an error and never reaches the engine.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional

import pyarrow as pa

from batchrun.job.schema import JobSpec


@dataclass
class Rendered:
    """One unit's rows turned into requests. errors[i] set: row i never reaches the engine.
    params[i]: row i's own SamplingParams when its source supplies per-row sampling (else None: the
    job's sampling section)."""
    prompts: list[Optional[str]]
    token_ids: list[Optional[list[int]]]
    errors: list[Optional[str]] = field(default_factory=list)
    params: list[Optional[Any]] = field(default_factory=list)


def _row_params(spec: JobSpec, table: pa.Table, errors: list[Optional[str]]) -> list[Optional[Any]]:
    """Per-row SamplingParams from the source's ROW_SAMPLING column (a JSON object of overrides of the
    job's sampling section) and from input.structured_outputs_column; a row whose overrides are invalid
    gets an error instead. Rows with the same overrides share one SamplingParams (checked once)."""
    from batchrun.connectors import ROW_SAMPLING
    from batchrun.outputs import SamplingParams
    n = table.num_rows
    params: list[Optional[Any]] = [None] * n
    col = spec.input.structured_outputs_column
    sampling = (table.column(ROW_SAMPLING).to_pylist() if ROW_SAMPLING in table.column_names else [None] * n)
    structured = table.column(col).to_pylist() if col else [None] * n
    if not any(sampling) and not any(v is not None for v in structured):
        return params
    base = spec.sampling.model_dump()
    made: dict[str, Any] = {}           # canonical overrides -> SamplingParams, or the error text
    for i, (raw, so) in enumerate(zip(sampling, structured)):
        if errors[i] is not None or (raw is None and so is None):
            continue
        row_over = json.loads(raw) if raw is not None else {}
        over = dict(row_over)
        if so is not None:
            try:
                over["structured_outputs"] = json.loads(so) if isinstance(so, (str, bytes)) else so
            except ValueError as e:
                errors[i] = f"input.structured_outputs_column {col!r}: not a JSON object ({e})"
                continue
        key = json.dumps(over, sort_keys=True, default=str)
        if key not in made:
            try:
                made[key] = SamplingParams(**{**base, **over})
            except (TypeError, ValueError) as e:
                where = (f"input.structured_outputs_column {col!r}" if raw is None
                         else f"per-row sampling {json.dumps(row_over, sort_keys=True)}")
                made[key] = f"{where}: {e}"
        if isinstance(made[key], str):
            errors[i] = made[key]
        else:
            params[i] = made[key]
    return params


def _decode_binary(row: dict[str, Any]) -> Optional[str]:
    """Binary values of a template row decoded as UTF-8 in place (formatting bytes would put their
    Python repr, b'...', in the prompt); the error for the row when one is not UTF-8."""
    for f, v in row.items():
        if isinstance(v, (bytes, bytearray)):
            try:
                row[f] = bytes(v).decode("utf-8")
            except UnicodeDecodeError as e:
                return (f"input.prompt_template: column {f!r} is binary and not UTF-8 text in this row "
                        f"(byte {e.start}: {e.reason})")
    return None


def _user_messages(text: str, system: Optional[str]) -> list[dict]:
    msgs = [{"role": "system", "content": system}] if system else []
    return msgs + [{"role": "user", "content": text}]


def render(spec: JobSpec, table: pa.Table, tokenizer) -> Rendered:
    """Prompts of each row of `table`: the template filled with the row's columns, optionally wrapped in
    the chat template, then tokenized in one batch. A row that cannot be rendered gets an error."""
    from batchrun.tokenizer import TokenizerError
    from batchrun.connectors import ROW_ERROR
    inp = spec.input
    n = table.num_rows
    prompts: list[Optional[str]] = [None] * n
    # a row the source could not read (a bad JSONL/CSV line) arrives with its error text
    errors: list[Optional[str]] = (table.column(ROW_ERROR).to_pylist() if ROW_ERROR in table.column_names
                                   else [None] * n)
    chat = inp.chat or inp.messages_column is not None
    if inp.messages_column:
        for i, conv in enumerate(table.column(inp.messages_column).to_pylist()):
            if errors[i] is not None:
                continue
            if conv is None:
                errors[i] = f"null messages (column {inp.messages_column!r})"
                continue
            if inp.system_prompt and not (conv and conv[0].get("role") == "system"):
                conv = [{"role": "system", "content": inp.system_prompt}] + conv
            try:
                prompts[i] = tokenizer.apply_chat_template(conv, add_generation_prompt=True)
            except (TokenizerError, TypeError, ValueError) as e:
                errors[i] = str(e)
    else:
        if inp.prompt_template is not None:
            fields = inp.template_fields()
            cols = {f: table.column(f).to_pylist() for f in fields}
            for i in range(n):
                if errors[i] is not None:
                    continue
                row = {f: cols[f][i] for f in fields}
                nulls = [f for f, v in row.items() if v is None]
                if nulls:
                    errors[i] = f"input.prompt_template: column {nulls[0]!r} is null in this row"
                    continue
                errors[i] = _decode_binary(row)
                if errors[i] is not None:
                    continue
                try:
                    prompts[i] = inp.prompt_template.format_map(row)
                except (KeyError, IndexError, ValueError, TypeError, AttributeError) as e:
                    errors[i] = f"input.prompt_template failed on this row: {type(e).__name__}: {e}"
        else:
            for i, v in enumerate(table.column(inp.prompt_column).to_pylist()):
                if errors[i] is not None:
                    continue
                if v is None:
                    errors[i] = f"null prompt (column {inp.prompt_column!r})"
                else:
                    prompts[i] = v
        if inp.chat:
            for i, text in enumerate(prompts):
                if text is None:
                    continue
                try:
                    prompts[i] = tokenizer.apply_chat_template(_user_messages(text, inp.system_prompt))
                except TokenizerError as e:
                    errors[i] = str(e)
                    prompts[i] = None
    params = _row_params(spec, table, errors)
    token_ids: list[Optional[list[int]]] = [None] * n
    todo = [i for i in range(n) if errors[i] is None and prompts[i]]
    for i in range(n):
        if errors[i] is None and not prompts[i]:
            token_ids[i] = []      # the engine reports an empty prompt as an error row
    for i, ids in zip(todo, tokenizer.encode_batch([prompts[i] for i in todo], add_special_tokens=not chat)):
        token_ids[i] = ids
    return Rendered(prompts, token_ids, errors, params)
