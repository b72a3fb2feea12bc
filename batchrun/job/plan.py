"""Planning a job: the input's units (from metadata), the fingerprint, prompt rendering, window order.

Everything here runs before any weight is loaded, so `validate` and a failing `submit` stay cheap.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

import pyarrow as pa

from batchrun.connectors import InputError, Source, Unit, open_source
from batchrun.job.spec import JobError, JobSpec
from batchrun.models.loader import ModelInfo, inspect_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json")


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
        model.torch_dtype(spec.model.dtype)
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
            check_group_size(model.config, spec.engine.quantization_group_size)
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


def _sha256_file(path: str) -> Optional[str]:
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except FileNotFoundError:
        return None


def _quantization_fp(spec: JobSpec) -> dict[str, Any]:
    """Quantization changes the outputs as dtype does; only when set, so unquantized manifests stay valid."""
    e = spec.engine
    if e.quantization is None:
        return {}
    return {"quantization": e.quantization, "quantize_lm_head": e.quantize_lm_head,
            **({"quantization_group_size": e.quantization_group_size} if e.quantization == "int4" else {})}


def job_fingerprint(spec: JobSpec, source: Source, model: ModelInfo) -> dict[str, Any]:
    """The identity of a job's results. Resuming is allowed only when every component is unchanged.

    Engine knobs that do not change results (max_num_seqs, block_size, ...) and the window order are
    left out, so they can be tuned between attempts; storage_options never enter (credentials).
    """
    inp = spec.input
    if model.format == "gguf":   # one file holds config, tokenizer and weights: its identity is the model's
        model_fp = {"gguf": model.identity}
    else:
        model_fp = {
            "config_sha256": _sha256_file(os.path.join(model.path, "config.json")),
            "weights": [[os.path.basename(f), os.path.getsize(f)] for f in model.weight_files],
            "tokenizer_sha256": {n: h for n in TOKENIZER_FILES
                                 if (h := _sha256_file(os.path.join(model.path, n))) is not None}}
    return {
        "model": model_fp | {"dtype": spec.model.dtype, "max_model_len": spec.engine.max_model_len}
        | _quantization_fp(spec),
        "sampling": spec.sampling.model_dump(mode="json"),
        "prompt": {k: getattr(inp, k) for k in ("id_column", "prompt_column", "messages_column",
                                                "prompt_template", "chat", "system_prompt", "passthrough")}
        | {"include_prompt": spec.output.include_prompt},
        "input": {"format": type(source).__name__, "files": source.listing.fingerprint(),
                  **({"sql": inp.sql} if inp.sql is not None else {})},
        "units": {"unit_rows": spec.plan.unit_rows},
        "output_schema": 2,      # 2: the `shared` column; outputs written without it are not resumed into
        # only when set, so the manifests of unpartitioned jobs stay valid
        **({"output": {"partition_by": spec.output.partition_by}} if spec.output.partition_by else {}),
    }


def fingerprint_hash(fp: dict) -> str:
    return hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:16]


# -- prompt rendering -------------------------------------------------------------------------
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
    job's sampling section); a row whose overrides are invalid gets an error instead."""
    from batchrun.connectors import ROW_SAMPLING
    from batchrun.outputs import SamplingParams
    params: list[Optional[Any]] = [None] * table.num_rows
    if ROW_SAMPLING not in table.column_names:
        return params
    base = spec.sampling.model_dump()
    for i, raw in enumerate(table.column(ROW_SAMPLING).to_pylist()):
        if raw is None or errors[i] is not None:
            continue
        over = json.loads(raw)
        try:
            params[i] = SamplingParams(**{**base, **over})
        except (TypeError, ValueError) as e:
            errors[i] = f"per-row sampling {json.dumps(over, sort_keys=True)}: {e}"
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


# -- the `validate` report --------------------------------------------------------------------
def _kv_budget_estimate(spec: JobSpec, weights_bytes: int, kv_bytes_per_token: int,
                        max_len: int) -> tuple[Optional[int], str]:
    """What the engine will size its KV cache to (runner.ModelRunner._kv_budget), without loading it."""
    if spec.engine.kv_cache_memory is not None:
        return int(spec.engine.kv_cache_memory), "engine.kv_cache_memory"
    import torch
    if spec.engine.device in ("auto", "cuda") and torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        return int(spec.engine.gpu_memory_utilization * total - weights_bytes), \
            "estimate: gpu_memory_utilization x GPU memory - weights (activations are profiled at load)"
    from batchrun.engine.config import DEVICE_DEFAULTS
    from batchrun.engine.kv_cache import blocks_needed
    from batchrun.engine.runner import _available_host_memory
    seqs = spec.engine.max_num_seqs or DEVICE_DEFAULTS["cpu"]["max_num_seqs"]
    bs = spec.engine.block_size
    useful = seqs * blocks_needed(max_len, bs) * bs * kv_bytes_per_token
    half = int(0.5 * _available_host_memory())
    return min(useful, half), (f"max_num_seqs {seqs} x max_model_len {max_len}" if useful <= half
                               else "half the available RAM") + "; pages touched only as used"


def _stats(xs: list[int]) -> dict[str, Any]:
    if not xs:
        return {"count": 0}
    s = sorted(xs)
    q = lambda p: s[min(len(s) - 1, int(p * len(s)))]  # noqa: E731
    return {"count": len(s), "min": s[0], "mean": round(sum(s) / len(s), 1), "p50": q(0.5), "p90": q(0.9),
            "p99": q(0.99), "max": s[-1]}


def plan_report(plan: JobPlan, sample: int = 256) -> dict[str, Any]:
    """What `batchrun validate` prints: files, units, rows, prompt-length statistics from a sample of the
    first rows, the memory ledger (from config.json and the safetensors headers, or the GGUF header: no
    weights load) and whether the output would start fresh, resume, or be refused."""
    from batchrun.connectors import ParquetSink
    from batchrun.job.ledger import SUCCESS, Ledger
    spec, info = plan.spec, plan.model
    cols = spec.input.columns()
    tables, got = [], 0
    for u in plan.units:
        if got >= sample:
            break
        t = plan.source.read(u, cols)
        tables.append(t.slice(0, sample - got))
        got += tables[-1].num_rows
    lengths, errors = [], []
    for t in tables:
        r = render(spec, t, plan.tokenizer)
        lengths += [len(ids) for ids, e in zip(r.token_ids, r.errors) if e is None]
        errors += [e for e in r.errors if e is not None]
    max_tokens = spec.sampling.max_tokens
    max_len = spec.engine.max_model_len or info.max_model_len
    dtype = info.torch_dtype(spec.model.dtype)
    kvb = info.kv_bytes_per_token(dtype)
    memory = info.memory_bytes(dtype)
    budget, how = _kv_budget_estimate(spec, memory, kvb, max_len)
    kv_tokens = None if budget is None else budget // kvb
    # on disk: the file's own tensor types (F32, BF16, Q4_1, ...); in memory: every parameter in `dtype`
    ledger = {"architecture": info.architecture, "format": info.format, "num_params": info.num_params,
              "weights_bytes": info.weights_bytes,
              "weights_on_disk": {k: {"tensors": n, "bytes": b} for k, (n, b) in
                                  sorted(info.tensor_types.items(), key=lambda kv: -kv[1][1])},
              "weights_memory_bytes": memory, "dtype": str(dtype).replace("torch.", ""),
              "kv_bytes_per_token": kvb, "max_model_len": max_len, "kv_cache_bytes": budget, "kv_budget": how,
              "kv_tokens": kv_tokens,
              "max_concurrency_at_max_model_len": None if kv_tokens is None else round(kv_tokens / max_len, 2),
              "max_num_seqs": spec.engine.max_num_seqs or "device default"}
    sink = ParquetSink(spec.output.uri, spec.output.storage_options, create=False)
    led = Ledger(sink)
    manifest = led.read_manifest()
    if manifest is None:
        output_state = "new"
    elif manifest.get("fingerprint") != plan.fingerprint and not led.done_markers():
        output_state = "new (a different job's manifest, with no unit committed: submit replaces it)"
    elif manifest.get("fingerprint") != plan.fingerprint:
        changed = sorted(k for k in plan.fingerprint if manifest["fingerprint"].get(k) != plan.fingerprint[k])
        output_state = f"holds a different job ({', '.join(changed)} changed): submit exits 4 unless --restart"
    elif led.exists(SUCCESS):
        output_state = "finished: submit has nothing left to do"
    else:
        output_state = f"resumable: {len(led.done_markers())} of {len(plan.units)} units committed"
    files = plan.source.listing.files
    return {
        "job": spec.name, "model": spec.model.path,
        "input": {"uri": spec.input.uri or f"sql: {spec.input.sql}",
                  "format": type(plan.source).__name__.replace("Source", "").lower(),
                  "files": len(files), "bytes": sum(f.size for f in files),
                  "first_files": [f.path for f in files[:5]], "columns": plan.source.schema.names},
        "plan": {"rows": plan.num_rows, "units": len(plan.units), "unit_rows": spec.plan.unit_rows,
                 "windows": -(-len(plan.units) // spec.plan.window_units), "window_units": spec.plan.window_units,
                 "order": spec.plan.order},
        "sample": {"rows": sum(t.num_rows for t in tables), "prompt_tokens": _stats(lengths),
                   "render_errors": len(errors), "first_error": errors[0] if errors else None,
                   "over_max_model_len": sum(1 for n in lengths if n + max_tokens > max_len)},
        "memory_ledger": ledger, "output": {"uri": sink.url, "state": output_state},
    }


def format_report(r: dict[str, Any]) -> str:
    """Human-readable `validate` output."""
    mib = lambda b: "-" if b is None else f"{b / 2**20:.1f} MiB"  # noqa: E731
    i, p, s, m = r["input"], r["plan"], r["sample"], r["memory_ledger"]
    pt = s["prompt_tokens"]
    lines = [f"job {r['job']}: OK",
             f"input   {i['uri']} ({i['format']}): {i['files']} file(s), {mib(i['bytes'])}, columns "
             f"{', '.join(i['columns'])}"]
    lines += [f"          {f}" for f in i["first_files"]]
    lines += [f"plan    {p['rows']} rows in {p['units']} units of <= {p['unit_rows']} rows, {p['windows']} "
              f"window(s) of {p['window_units']} units, order: {p['order']}"]
    if pt["count"]:
        lines.append(f"prompts sample of {s['rows']} rows: tokens min {pt['min']} mean {pt['mean']} p50 {pt['p50']} "
                     f"p90 {pt['p90']} p99 {pt['p99']} max {pt['max']}; {s['over_max_model_len']} over "
                     f"max_model_len; {s['render_errors']} render errors")
    else:
        lines.append(f"prompts sample of {s['rows']} rows: none renderable ({s['render_errors']} render errors)")
    if s["first_error"]:
        lines.append(f"          first error: {s['first_error']}")
    lines += [f"model   {r['model']}: {m['architecture']} ({m['format']}), {m['num_params'] / 1e6:.2f}M params, "
              f"max_model_len {m['max_model_len']}",
              f"weights on disk {mib(m['weights_bytes'])} -> in memory {mib(m['weights_memory_bytes'])} "
              f"({m['num_params'] / 1e6:.2f}M params x {m['dtype']})"]
    lines += [f"          {kind:<5} {t['tensors']:>5} tensor{'s' if t['tensors'] != 1 else ' '} {mib(t['bytes']):>12}"
              for kind, t in m["weights_on_disk"].items()]
    lines += [f"memory  KV {m['kv_bytes_per_token']} B/token; cache {mib(m['kv_cache_bytes'])} ({m['kv_budget']})"
              f" = {m['kv_tokens']} tokens = {m['max_concurrency_at_max_model_len']} sequences at max_model_len; "
              f"max_num_seqs {m['max_num_seqs']}",
              f"output  {r['output']['uri']}: {r['output']['state']}"]
    return "\n".join(lines)
