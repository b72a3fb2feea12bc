"""The job file: YAML, read with yaml.safe_load and validated with pydantic.

An unknown or misspelt key is an error naming its path (`engine.max_num_seq: unknown key, did you
mean max_num_seqs?`). `--set a.b=value` overrides any key, the value parsed as YAML. Relative paths are
relative to the job file's directory.
"""
from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import os
import re
import string
import typing
from typing import Any, Literal, Optional, Union

import yaml
from pydantic import (BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, create_model, field_validator,
                      model_validator)

from batchrun.engine.config import EngineConfig
from batchrun.outputs import SamplingParams


OUTPUT_COLUMNS = ("id", "output", "finish_reason", "error", "prompt_tokens", "output_tokens", "shared", "prompt")


class JobError(ValueError):
    """A bad job file; the message names the file and the key."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelSpec(_Strict):
    """model: the HF model directory and its dtype."""
    path: str
    dtype: str = "auto"


class InputSpec(_Strict):
    """input: where the prompts are and how each row becomes one.

    uri: files (any fsspec URL); or sql: a DuckDB query, run once per output and staged under
    `<output>/_batchrun/input/`. format openai_batch: OpenAI Batch API request lines; the id is
    custom_id, the prompt body.messages, and the body's sampling keys override `sampling` per row."""
    uri: Optional[str] = None
    sql: Optional[str] = None
    format: Optional[Literal["parquet", "jsonl", "csv", "openai_batch"]] = None
    id_column: Optional[str] = None
    prompt_column: Optional[str] = None
    messages_column: Optional[str] = None
    prompt_template: Optional[str] = None
    chat: bool = False
    system_prompt: Optional[str] = None
    passthrough: list[str] = Field(default_factory=list)
    storage_options: dict[str, Any] = Field(default_factory=dict)

    _base_dir: str = PrivateAttr(".")      # the job file's directory: relative paths inside input.sql

    @model_validator(mode="after")
    def _one_prompt_source(self):
        if (self.uri is None) == (self.sql is None):
            raise ValueError("set exactly one of uri (files) and sql (a DuckDB query)")
        if self.sql is not None and self.format is not None:
            raise ValueError("format applies to uri, not to sql")
        if self.format == "openai_batch":     # the request lines say it all: id custom_id, body.messages
            for key, fixed in (("id_column", "custom_id"), ("messages_column", "messages"),
                               ("prompt_column", None), ("prompt_template", None)):
                if getattr(self, key) not in (None, fixed):
                    raise ValueError(f"{key} does not apply to format openai_batch (custom_id is the id, "
                                     "body.messages the prompt)")
            self.id_column, self.messages_column = "custom_id", "messages"
        if self.messages_column is not None and (self.prompt_column or self.prompt_template):
            raise ValueError("messages_column cannot be combined with prompt_column or prompt_template")
        if self.prompt_column is None and self.messages_column is None and self.prompt_template is None:
            raise ValueError("set exactly one of prompt_column, messages_column (or a prompt_template)")
        clash = [c for c in self.passthrough if c in OUTPUT_COLUMNS]
        if clash:
            raise ValueError(f"passthrough column(s) {', '.join(clash)} would collide with the output's own "
                             f"columns ({', '.join(OUTPUT_COLUMNS)}); the id is always written as `id`")
        if len(set(self.passthrough)) != len(self.passthrough):
            raise ValueError("passthrough lists a column twice")
        return self

    def template_fields(self) -> list[str]:
        if self.prompt_template is None:
            return []
        try:
            names = [f for _, f, _, _ in string.Formatter().parse(self.prompt_template) if f is not None]
        except ValueError as e:
            raise JobError(f"input.prompt_template: {e}") from e
        fields = []
        for n in names:
            base = re.split(r"[.\[]", n, maxsplit=1)[0]
            if not base or base.isdigit():
                raise JobError(f"input.prompt_template: placeholder {{{n}}} must name a column, e.g. {{text}}")
            fields.append(base)
        return list(dict.fromkeys(fields))

    def columns(self) -> list[str]:
        cols = [self.id_column, self.prompt_column, self.messages_column, *self.template_fields(), *self.passthrough]
        return list(dict.fromkeys(c for c in cols if c))


class OutputSpec(_Strict):
    """output: where results go (part-<k>.parquet files and the _batchrun/ ledger)."""
    uri: str
    include_prompt: bool = False
    storage_options: dict[str, Any] = Field(default_factory=dict)
    partition_by: list[str] = Field(default_factory=list)   # hive-style c=v/ directories; passthrough columns
    openai_jsonl: bool = False     # also write <uri>/openai_output.jsonl in OpenAI Batch output format


class PlanSpec(_Strict):
    """plan: how the input is cut into checkpoint units and ordered."""
    unit_rows: int = Field(2048, ge=1)
    window_units: int = Field(8, ge=1)
    order: Literal["length", "input"] = "length"


def _model_from_dataclass(name: str, cls, skip: set[str]):
    hints = typing.get_type_hints(cls)
    spec = {}
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        spec[f.name] = (hints[f.name], default)
    return create_model(name, __base__=_Strict, **spec)


class RuntimeSpec(_Strict):
    """runtime: where the job runs. `local` (default): this process, one engine. `ray`: one engine replica
    per Ray actor, over the same units and ledger (batchrun.job.ray_runner; needs `batchrun[ray]`)."""
    backend: Literal["local", "ray"] = "local"
    address: Optional[str] = None              # ray.init address: None = $RAY_ADDRESS or a new local Ray;
    #                                            "auto" = the cluster `ray start` joined this machine to
    replicas: Optional[int] = Field(None, ge=1)        # None: as many as the cluster's GPUs (or CPUs) fit
    gpus_per_replica: Optional[float] = Field(None, ge=0)   # None: 1 if the cluster has GPUs, else 0
    cpus_per_replica: float = Field(1.0, gt=0)          # also the replica's torch thread count (rounded up)
    max_restarts: int = Field(3, ge=0)                  # Ray restarts of a dead replica before giving up on it
    max_unit_attempts: int = Field(3, ge=1)             # a unit failing this often is committed as error rows
    units_in_flight: Optional[int] = Field(None, ge=1)  # per replica; None: 2 x plan.window_units


SamplingSpec = _model_from_dataclass("SamplingSpec", SamplingParams, {"n"})
EngineSpec = _model_from_dataclass("EngineSpec", EngineConfig, {"model", "dtype", "extra"})


class JobSpec(_Strict):
    """A whole job file. See jobs/*.yaml and the README for every key."""
    name: str
    model: ModelSpec
    input: InputSpec
    output: OutputSpec
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)      # type: ignore[valid-type]
    engine: EngineSpec = Field(default_factory=EngineSpec)            # type: ignore[valid-type]
    plan: PlanSpec = Field(default_factory=PlanSpec)
    runtime: RuntimeSpec = Field(default_factory=RuntimeSpec)
    # identical rows (same prompt token ids, same deterministic sampling) computed once (job/dedupe.py)
    dedupe: bool = True

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", v):
            raise ValueError("use letters, digits, '_', '.' and '-'")
        return v

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(**self.sampling.model_dump())

    def engine_kwargs(self) -> dict[str, Any]:
        kw = self.engine.model_dump()
        if "enable_prefix_caching" not in self.engine.model_fields_set:
            kw["enable_prefix_caching"] = True     # jobs default it on: length-ordered windows make it pay
        return kw


def _known_keys(model: type[BaseModel], loc: tuple) -> list[str]:
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        if field is None:
            return []
        ann = field.annotation
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return []
        model = ann
    return list(model.model_fields)


def _format_errors(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        loc = tuple(e["loc"])
        path = ".".join(str(x) for x in loc) or "(top level)"
        if e["type"] == "extra_forbidden":
            known = _known_keys(JobSpec, loc)
            guess = difflib.get_close_matches(str(loc[-1]), known, n=1)
            hint = f", did you mean {guess[0]}?" if guess else f" (known: {', '.join(known)})"
            lines.append(f"{path}: unknown key{hint}")
        elif e["type"] == "missing":
            lines.append(f"{path}: required key missing")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            lines.append(f"{path}: {msg}")
    return f"{source}: invalid job file: " + "; ".join(lines)


def _yaml_problem(e: yaml.YAMLError) -> str:
    """`line 3, column 7: mapping values are not allowed here`: where and what, on one line."""
    mark = getattr(e, "problem_mark", None)
    what = getattr(e, "problem", None) or str(e)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return " ".join(f"{where}{what}".split())


def apply_override(data: dict, assignment: str) -> None:
    """`a.b.c=value` -> data['a']['b']['c'] = yaml.safe_load(value)."""
    if "=" not in assignment:
        raise JobError(f"--set {assignment!r}: expected key.path=value")
    key, raw = assignment.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise JobError(f"--set {assignment!r}: expected key.path=value (an empty key name)")
    node = data
    for i, p in enumerate(parts[:-1]):
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise JobError(f"--set {key}: {'.'.join(parts[:i + 1])} is not a mapping")
    try:
        node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise JobError(f"--set {key}: the value {raw!r} is not valid YAML ({_yaml_problem(e)})") from None


def _resolve(path: str, base: str) -> str:
    if "://" in path or os.path.isabs(path):
        return path
    return os.path.normpath(os.path.join(base, path))


def parse_job(data: Any, source: str = "<job>", base_dir: str = ".") -> JobSpec:
    if not isinstance(data, dict):
        raise JobError(f"{source}: a job file is a YAML mapping")
    try:
        spec = JobSpec.model_validate(data)
    except ValidationError as e:
        raise JobError(_format_errors(e, source)) from None
    spec.model.path = _resolve(spec.model.path, base_dir)
    if spec.input.uri is not None:
        spec.input.uri = _resolve(spec.input.uri, base_dir) + ("/" if spec.input.uri.endswith("/") else "")
    spec.input._base_dir = os.path.abspath(base_dir)
    spec.output.uri = _resolve(spec.output.uri, base_dir)
    spec.input.template_fields()
    _check_storage(spec, source)
    _check_output_location(spec, source)
    try:
        spec.sampling_params()
        EngineConfig(model=spec.model.path, dtype=spec.model.dtype, **spec.engine_kwargs())
    except (ValueError, TypeError) as e:
        raise JobError(f"{source}: {e}") from None
    try:      # read only when the engine starts: a bad value would surface after the output is touched
        from batchrun.engine.speculative import SpecConfig
        SpecConfig.from_dict(spec.engine.speculative_config)
    except (ValueError, TypeError) as e:
        raise JobError(f"{source}: engine.speculative_config: {e}") from None
    return spec


def _check_storage(spec: JobSpec, source: str) -> None:
    """output.partition_by names passthrough columns; every `${VAR}` in storage_options is set (the
    values are substituted only when a filesystem is built: connectors/secrets.py)."""
    from batchrun.connectors.secrets import MissingEnvVar, check_references
    part = spec.output.partition_by
    missing = [c for c in part if c not in spec.input.passthrough]
    if missing:
        raise JobError(f"{source}: output.partition_by: column {missing[0]!r} is not an input.passthrough "
                       f"column (passthrough: {', '.join(spec.input.passthrough) or 'none'}); partition "
                       "columns are copied from the input")
    if len(set(part)) != len(part):
        raise JobError(f"{source}: output.partition_by lists a column twice")
    try:
        check_references(spec.input.storage_options, "input.storage_options")
        check_references(spec.output.storage_options, "output.storage_options")
    except MissingEnvVar as e:
        raise JobError(f"{source}: {e}") from None


def _check_output_location(spec: JobSpec, source: str) -> None:
    """output.uri must not be where input.uri lists its files from: the next submit would read the
    results back as input (and refuse the changed listing). A `_`- or `.`-named folder is never listed."""
    if spec.input.uri is None:
        return
    out = spec.output.uri.removeprefix("file://").rstrip("/")
    inp = spec.input.uri.removeprefix("file://").rstrip("/")
    if any(ch in inp for ch in "*?["):       # segment by segment: a glob's `*` stops at `/` unless `**`
        part, pattern = f"{out}/part-000000.parquet".split("/"), inp.split("/")
        inside = fnmatch.fnmatchcase("/".join(part), inp) if "**" in inp else \
            len(part) == len(pattern) and all(fnmatch.fnmatchcase(a, b) for a, b in zip(part, pattern))
    else:
        rest = out[len(inp):].lstrip("/") if out == inp or out.startswith(inp + "/") else None
        inside = rest is not None and not any(p.startswith(("_", ".")) for p in rest.split("/") if p)
    if inside:
        raise JobError(f"{source}: output.uri {spec.output.uri} lies inside input.uri {spec.input.uri}: its "
                       "part files would be read back as input; use another folder (or one named _out)")


def load_job(path: str, overrides: Union[list[str], tuple[str, ...]] = ()) -> JobSpec:
    """Read and validate a job file, applying `--set` overrides first."""
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        raise JobError(f"{path}: no such job file") from None
    except IsADirectoryError:
        raise JobError(f"{path}: is a directory, not a job file") from None
    except OSError as e:          # unreadable (permissions, I/O): nothing else can be read either
        raise JobError(f"{path}: cannot read the job file ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise JobError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    except yaml.YAMLError as e:
        raise JobError(f"{path}: not valid YAML ({_yaml_problem(e)})") from None
    data = data if data is not None else {}
    if not isinstance(data, dict):      # before --set, which walks mappings
        raise JobError(f"{path}: a job file is a YAML mapping, found a {type(data).__name__}")
    for o in overrides:
        apply_override(data, o)
    return parse_job(data, path, os.path.dirname(os.path.abspath(path)))
