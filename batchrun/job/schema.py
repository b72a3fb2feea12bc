"""The job file's schema: JobSpec and its sections, validated with pydantic and frozen once validated.

Relative paths (model.path, input.uri, output.uri) are resolved against the job file's directory while
validating, given as the validation context `{"base_dir": ...}` (spec.parse_job does); without a context
they stay as written. Nothing changes a JobSpec after validation: a different value is a new JobSpec
(`model_copy(update=...)`).
"""
from __future__ import annotations

import dataclasses
import os
import re
import string
import typing
from typing import Any, Literal, Optional

from pydantic import (BaseModel, ConfigDict, Field, PrivateAttr, ValidationInfo, create_model, field_validator,
                      model_validator)

from batchrun.engine.config import EngineConfig
from batchrun.outputs import SamplingParams


OUTPUT_COLUMNS = ("id", "output", "finish_reason", "error", "prompt_tokens", "output_tokens", "shared", "prompt",
                  "sample_index", "logprobs", "top_logprobs", "prompt_logprobs", "prompt_top_logprobs")


class JobError(ValueError):
    """A bad job file; the message names the file and the key."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _job_dir(info: ValidationInfo) -> Optional[str]:
    return (info.context or {}).get("base_dir")


def _relative_to_job_file(path: str, info: ValidationInfo) -> str:
    """`path` joined to the job file's directory; URLs, absolute paths and context-free validation: as is."""
    base = _job_dir(info)
    if base is None or "://" in path or os.path.isabs(path):
        return path
    return os.path.normpath(os.path.join(base, path))


class ModelSpec(_Strict):
    """model: the HF model directory and its dtype."""
    path: str
    dtype: str = "auto"

    @field_validator("path")
    @classmethod
    def _path(cls, v: str, info: ValidationInfo) -> str:
        return _relative_to_job_file(v, info)


class InputSpec(_Strict):
    """input: where the prompts are and how each row becomes one.

    uri: files (any fsspec URL); or sql: a DuckDB query, run once per output and staged under
    `<output>/_batchrun/input/`. format openai_batch: OpenAI Batch API request lines; the id is
    custom_id, the prompt body.messages, and the body's sampling keys override `sampling` per row.
    structured_outputs_column: a column whose value (a JSON object, as text or a struct) is the row's own
    `sampling.structured_outputs` ({"json": schema} | {"regex": ...} | {"choice": [...]} | ...); null: the
    job's."""
    uri: Optional[str] = None
    sql: Optional[str] = None
    format: Optional[Literal["parquet", "jsonl", "csv", "openai_batch"]] = None
    id_column: Optional[str] = None
    prompt_column: Optional[str] = None
    messages_column: Optional[str] = None
    prompt_template: Optional[str] = None
    chat: bool = False
    system_prompt: Optional[str] = None
    structured_outputs_column: Optional[str] = None
    passthrough: list[str] = Field(default_factory=list)
    storage_options: dict[str, Any] = Field(default_factory=dict)

    _base_dir: str = PrivateAttr(".")      # the job file's directory: relative paths inside input.sql

    @field_validator("uri")
    @classmethod
    def _uri(cls, v: Optional[str], info: ValidationInfo) -> Optional[str]:
        if v is None:
            return v
        return _relative_to_job_file(v, info) + ("/" if v.endswith("/") else "")   # a folder stays one

    @model_validator(mode="after")
    def _one_prompt_source(self, info: ValidationInfo):
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
            self = self.model_copy(update={"id_column": "custom_id", "messages_column": "messages"})
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
        if _job_dir(info) is not None:
            self._base_dir = os.path.abspath(_job_dir(info))
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
        cols = [self.id_column, self.prompt_column, self.messages_column, *self.template_fields(),
                self.structured_outputs_column, *self.passthrough]
        return list(dict.fromkeys(c for c in cols if c))


class OutputSpec(_Strict):
    """output: where results go (part-<k>.parquet files and the _batchrun/ ledger)."""
    uri: str
    include_prompt: bool = False
    storage_options: dict[str, Any] = Field(default_factory=dict)
    partition_by: list[str] = Field(default_factory=list)   # hive-style c=v/ directories; passthrough columns
    openai_jsonl: bool = False     # also write <uri>/openai_output.jsonl in OpenAI Batch output format

    @field_validator("uri")
    @classmethod
    def _uri(cls, v: str, info: ValidationInfo) -> str:
        return _relative_to_job_file(v, info)


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
    gpus_per_replica: Optional[float] = Field(None, ge=0)   # None: tensor_parallel_size if the cluster has GPUs, else 0
    cpus_per_replica: float = Field(1.0, gt=0)          # also the replica's torch thread count (rounded up)
    max_restarts: int = Field(3, ge=0)                  # Ray restarts of a dead replica before giving up on it
    max_unit_attempts: int = Field(3, ge=1)             # a unit failing this often is committed as error rows
    units_in_flight: Optional[int] = Field(None, ge=1)  # per replica; None: 2 x plan.window_units


SamplingSpec = _model_from_dataclass("SamplingSpec", SamplingParams, set())
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
        """EngineConfig's keyword arguments: the engine section, every unset knob at EngineConfig's default."""
        return self.engine.model_dump()
