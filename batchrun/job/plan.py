"""Turning input rows into engine requests: prompt rendering, tokenizing, and the order inside a window."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import pyarrow as pa

from batchrun.connectors.base import Unit
from batchrun.job.spec import JobSpec

PREFIX_TOKENS = 32     # rows agreeing on this many leading tokens are kept adjacent (prefix-cache hits)


@dataclass
class UnitWork:
    """One unit, read and rendered: the rows' ids and passthrough columns, and one request per row."""
    unit: Unit
    table: pa.Table                        # id + passthrough (+ prompt) columns, input order
    ids: list[Any]
    prompts: list[Optional[str]]
    token_ids: list[Optional[list[int]]]
    errors: list[Optional[str]]            # set: the row is an error row and never reaches the engine


def _user_messages(spec: JobSpec, text: str) -> list[dict]:
    msgs = [{"role": "system", "content": spec.input.system_prompt}] if spec.input.system_prompt else []
    return msgs + [{"role": "user", "content": text}]


def render(spec: JobSpec, table: pa.Table, tokenizer) -> tuple[list[Optional[str]], list[Optional[str]]]:
    """Per row: (prompt text or None, error or None). A failure on one row never stops the others."""
    inp = spec.input
    n = table.num_rows
    prompts: list[Optional[str]] = [None] * n
    errors: list[Optional[str]] = [None] * n
    if inp.messages_column:
        for i, conv in enumerate(table.column(inp.messages_column).to_pylist()):
            if not conv:
                errors[i] = f"{inp.messages_column} is null or empty"
                continue
            try:
                prompts[i] = tokenizer.apply_chat_template(list(conv), add_generation_prompt=True)
            except Exception as e:     # a template may raise anything on odd data
                errors[i] = f"chat template failed: {e}"
        return prompts, errors
    fields = inp.template_fields()
    cols = {c: table.column(c).to_pylist() for c in ([inp.prompt_column] if inp.prompt_column else []) + fields}
    for i in range(n):
        if inp.prompt_template is not None:
            values = {f: cols[f][i] for f in fields}
            nulls = [f for f, v in values.items() if v is None]
            if nulls:
                errors[i] = f"column {nulls[0]} is null"
                continue
            try:
                text = inp.prompt_template.format_map(values)
            except (KeyError, ValueError, IndexError, AttributeError) as e:
                errors[i] = f"prompt_template failed: {e!r}"
                continue
        else:
            text = cols[inp.prompt_column][i]
            if text is None:
                errors[i] = f"column {inp.prompt_column} is null"
                continue
            text = str(text)
        if not text.strip():
            errors[i] = "empty prompt"
            continue
        if inp.chat:
            try:
                text = tokenizer.apply_chat_template(_user_messages(spec, text), add_generation_prompt=True)
            except Exception as e:
                errors[i] = f"chat template failed: {e}"
                continue
        prompts[i] = text
    return prompts, errors


def tokenize(spec: JobSpec, prompts: list[Optional[str]], tokenizer) -> list[Optional[list[int]]]:
    chat = bool(spec.input.chat or spec.input.messages_column)
    todo = [i for i, p in enumerate(prompts) if p is not None]
    out: list[Optional[list[int]]] = [None] * len(prompts)
    for i, ids in zip(todo, tokenizer.encode_batch([prompts[i] for i in todo], add_special_tokens=not chat)):
        out[i] = ids
    return out


def order_window(works: list[UnitWork], max_tokens: int, order: str) -> list[tuple[int, int]]:
    """(work index, row) pairs of a window's requests: longest (prompt + max_tokens) first, rows sharing
    their first PREFIX_TOKENS tokens adjacent (each group placed by its longest member); or input order."""
    pairs = [(w, r) for w, work in enumerate(works) for r, ids in enumerate(work.token_ids) if ids is not None]
    if order == "input":
        return pairs
    groups: dict[tuple, list[tuple[int, int]]] = {}
    for w, r in pairs:
        groups.setdefault(tuple(works[w].token_ids[r][:PREFIX_TOKENS]), []).append((w, r))
    length = lambda p: len(works[p[0]].token_ids[p[1]]) + max_tokens  # noqa: E731
    ordered = []
    for members in groups.values():
        members.sort(key=length, reverse=True)
    for members in sorted(groups.values(), key=lambda m: length(m[0]), reverse=True):
        ordered.extend(members)
    return ordered
