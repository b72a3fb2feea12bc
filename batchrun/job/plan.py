"""Planning a job: the input's units (from metadata), its columns and model checked, the fingerprint, and the
window order. Everything here runs before any weight is loaded, so `validate` and a failing `submit` stay
cheap. Prompt rendering (render.py) and the fingerprint (fingerprint.py) are importable from here too.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence, Union

import pyarrow as pa

from batchrun.connectors import InputError, Source, Unit, open_source
from batchrun.engine.config import quantization_group
from batchrun.job.fingerprint import TOKENIZER_FILES, fingerprint_hash, job_fingerprint
from batchrun.job.render import Rendered, render
from batchrun.job.schema import JobError, JobSpec

if TYPE_CHECKING:       # models.loader imports torch: only once the input has been checked (make_plan)
    from batchrun.models.loader import ModelInfo

__all__ = ["JobPlan", "make_plan", "check_model_settings", "check_columns", "windows", "length_order",
           # importable from here as before the split
           "TOKENIZER_FILES", "fingerprint_hash", "job_fingerprint", "Rendered", "render"]


@dataclass
class JobPlan:
    """What a job will do, known without loading weights."""
    spec: JobSpec
    source: Source
    units: list[Unit]
    model: ModelInfo
    fingerprint: dict[str, Any]
    tokenizer: Any = None

    @property
    def num_rows(self) -> int:
        return sum(u.num_rows for u in self.units)

    def info(self) -> dict[str, Any]:
        """Plan facts stored in the manifest (so `status` knows the totals)."""
        return {"job": self.spec.name, "units_total": len(self.units), "rows_total": self.num_rows,
                "files": len(self.source.listing.files)}


def make_plan(spec: JobSpec, load_tokenizer: bool = True, restart: bool = False,
              stage_input: bool = True) -> JobPlan:
    """Open the input, check its columns, inspect the model (config only) and fingerprint the job.

    input.sql: the query runs here, after the model checks, unless an earlier submit staged its
    result under the output (connectors/duckdb_sql.py); restart runs it again; stage_input=False
    (validate) writes nothing under the output.
    Raises InputError (input or model unusable) or JobError (the job file asks for something impossible).
    """
    if spec.input.sql is None:
        source = open_source(spec.input.uri, spec.input.format, spec.input.storage_options)
        check_columns(spec, source)
    from batchrun.models.loader import inspect_model
    try:
        model = inspect_model(spec.model.path)
    except ValueError as e:
        raise InputError(f"model.path: {e}") from e
    check_model_settings(spec, model)
    tokenizer = None
    if load_tokenizer:
        from batchrun.tokenizer import load_tokenizer as _load_tokenizer
        try:
            tokenizer = _load_tokenizer(spec.model.path)
        except (ValueError, OSError) as e:
            raise InputError(f"model.path: {spec.model.path}: tokenizer: {e}") from e
        if (spec.input.chat or spec.input.messages_column) and not tokenizer.chat_template:
            raise JobError(f"input.chat: {spec.model.path} has no chat template (tokenizer_config.json "
                           "chat_template); set chat: false")
    if spec.input.sql is not None:
        from batchrun.connectors.duckdb_sql import open_sql_source
        source = open_sql_source(spec.input.sql, spec.output.uri, spec.output.storage_options,
                                 spec.input.storage_options, spec.input._base_dir, spec.plan.unit_rows,
                                 restart=restart, stage=stage_input)
        check_columns(spec, source)
    units = source.units(spec.plan.unit_rows)
    return JobPlan(spec, source, units, model, job_fingerprint(spec, source, model), tokenizer)


def check_model_settings(spec: JobSpec, model: ModelInfo) -> None:
    """model.dtype and engine.max_model_len against the model, before any weight loads (and before the
    output is touched): a typo there fails as a bad job file, not at engine start."""
    try:
        model.dtype_name(spec.model.dtype)
    except ValueError as e:
        if spec.model.dtype == "auto":      # the model's own config names a dtype batchrun cannot load
            raise InputError(f"model.path: {model.path}: config dtype: {e}; set model.dtype") from None
        raise JobError(f"model.dtype: {e}") from None
    asked = spec.engine.max_model_len
    if asked is not None and asked > model.max_model_len:
        where = "the GGUF metadata" if model.format == "gguf" else os.path.join(model.path, "config.json")
        raise JobError(f"engine.max_model_len: {asked} exceeds the model's {model.max_model_len} "
                       f"(max_position_embeddings in {where})")
    if spec.engine.quantization == "int4":      # the device and "gguf" on a non-GGUF model: at engine start
        from batchrun.models.quant import check_group_size
        try:
            check_group_size(model.config, quantization_group("int4", spec.engine.quantization_group_size))
        except ValueError as e:
            raise JobError(f"engine.{e}") from None
    if isinstance(spec.engine.quantization_calibration, str):   # a missing or empty file: a bad job file
        from batchrun.models.calibration import read_prompts
        try:
            read_prompts(spec.engine.quantization_calibration)
        except ValueError as e:
            raise JobError(f"engine.{e}") from None
    if spec.engine.tensor_parallel_size != 1:   # sizes against the model and this machine's cores/GPUs
        from batchrun.engine.tp_group import check_tp_settings
        try:
            check_tp_settings(spec.engine, model)
        except ValueError as e:
            raise JobError(f"engine.{e}") from None


def check_columns(spec: JobSpec, source: Source) -> None:
    """Every column the job names exists, with a usable type; the message names file and column."""
    import difflib
    inp = spec.input
    schema = source.schema
    where = "the result of input.sql" if inp.sql is not None else source.listing.files[0].path
    roles = [("id_column", inp.id_column), ("prompt_column", inp.prompt_column),
             ("messages_column", inp.messages_column)]
    roles += [("prompt_template", c) for c in inp.template_fields()]
    roles += [("passthrough", c) for c in inp.passthrough]
    for key, col in roles:
        if col is not None and col not in schema.names:
            guess = difflib.get_close_matches(col, schema.names, n=1)
            hint = f"; did you mean {guess[0]!r}?" if guess else ""
            raise InputError(f"input.{key}: column {col!r} not found in {where} "
                             f"(columns: {', '.join(schema.names)}){hint}")
    if inp.prompt_column and not inp.prompt_template:
        t = schema.field(inp.prompt_column).type
        if not (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_null(t)):
            raise InputError(f"input.prompt_column: column {inp.prompt_column!r} of {where} is {t}, not a "
                             "string; use a prompt_template such as \"{" + inp.prompt_column + "}\" to format it")
    if inp.messages_column:
        t = schema.field(inp.messages_column).type
        ok = (pa.types.is_list(t) or pa.types.is_large_list(t)) and pa.types.is_struct(t.value_type) \
            and {"role", "content"} <= {f.name for f in t.value_type}
        if not ok:
            raise InputError(f"input.messages_column: column {inp.messages_column!r} of {where} is {t}; "
                             "expected list<struct<role: string, content: string>>")


# -- windows and order ------------------------------------------------------------------------
def windows(units: Sequence[Unit], window_units: int) -> list[list[Unit]]:
    """Consecutive runs of `window_units` units: the scope of length ordering."""
    return [list(units[i:i + window_units]) for i in range(0, len(units), window_units)]


def length_order(token_ids: Sequence[Sequence[int]], max_tokens: Union[int, Sequence[int]],
                 block_size: int) -> list[int]:
    """Indices in submission order: longest (prompt + max_tokens) first, and prompts whose first KV
    block is identical kept adjacent (so a shared prefix is computed while its blocks are cached).
    max_tokens: one for all rows, or each row's own (per-row sampling: OpenAI Batch max_completion_tokens).

    Rows are grouped by their first `block_size` tokens; groups go longest-member first, and inside a
    group longest first. Ties keep input order, so the order is deterministic.
    """
    groups: dict[tuple, list[int]] = {}
    for i, ids in enumerate(token_ids):
        groups.setdefault(tuple(ids[:block_size]), []).append(i)
    limits = [max_tokens] * len(token_ids) if isinstance(max_tokens, int) else list(max_tokens)
    total = [len(ids) + m for ids, m in zip(token_ids, limits)]
    for g in groups.values():
        g.sort(key=lambda i: (-total[i], i))
    ordered = sorted(groups.values(), key=lambda g: (-total[g[0]], g[0]))
    return [i for g in ordered for i in g]
