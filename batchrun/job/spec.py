"""The job file: YAML, read with yaml.safe_load and validated against batchrun.job.schema.

An unknown or misspelt key is an error naming its path (`engine.max_num_seq: unknown key, did you
mean max_num_seqs?`). `--set a.b=value` overrides any key, the value parsed as YAML. Relative paths are
relative to the job file's directory. JobSpec and its sections live in schema.py and are importable
from here too.
"""
from __future__ import annotations

import difflib
import fnmatch
import os
from typing import Any, Union

import yaml
from pydantic import BaseModel, ValidationError

from batchrun.engine.config import EngineConfig
from batchrun.job.schema import (OUTPUT_COLUMNS, EngineSpec, InputSpec, JobError, JobSpec, ModelSpec,
                                 OutputSpec, PlanSpec, RuntimeSpec, SamplingSpec)

__all__ = ["JobError", "JobSpec", "apply_override", "load_job", "parse_job",        # the schema's names too:
           "OUTPUT_COLUMNS", "EngineSpec", "InputSpec", "ModelSpec", "OutputSpec",  # importable from here
           "PlanSpec", "RuntimeSpec", "SamplingSpec"]


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


def parse_job(data: Any, source: str = "<job>", base_dir: str = ".") -> JobSpec:
    """Validate a job file's mapping (relative paths resolved against base_dir, the file's directory), then
    check what the schema alone cannot: storage references, the output's location, the engine knobs
    together and speculative_config. The JobSpec returned is frozen. Raises JobError naming `source`."""
    if not isinstance(data, dict):
        raise JobError(f"{source}: a job file is a YAML mapping")
    try:
        spec = JobSpec.model_validate(data, context={"base_dir": base_dir})
    except ValidationError as e:
        raise JobError(_format_errors(e, source)) from None
    spec.input.template_fields()
    _check_storage(spec, source)
    _check_output_location(spec, source)
    try:
        spec.sampling_params()
    except (ValueError, TypeError) as e:
        raise JobError(f"{source}: sampling: {e}") from None
    try:
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
