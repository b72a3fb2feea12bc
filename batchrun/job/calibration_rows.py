"""quantization_calibration's rows from the job's own input: the first prompts' token ids.

Read only when the engine will calibrate (models/calibration.needs_calibration) and the knob is a row count:
units from the start of the input are rendered as the pipeline renders them (template, chat template,
tokenizer) until 4 x N rows are seen, then models/calibration.pick_rows keeps N, the long ones included.
Rows that cannot be rendered are skipped here (the pipeline makes them error rows as usual).
"""
from __future__ import annotations

from typing import Optional

SCAN_FACTOR = 4       # rows looked at per row kept: enough to find the long ones without reading the input


def job_calibration_rows(plan) -> Optional[list[list[int]]]:
    """Token rows for the engine's calibration pass, or None when it runs none or reads a file."""
    from batchrun.engine.config import EngineConfig
    from batchrun.job.render import render
    from batchrun.models.calibration import DEFAULT_ROWS, needs_calibration
    spec = plan.spec
    cfg = EngineConfig(model=spec.model.path, dtype=spec.model.dtype, **spec.engine_kwargs())
    if plan.tokenizer is None or not needs_calibration(cfg) or isinstance(cfg.quantization_calibration, str):
        return None
    want = (cfg.quantization_calibration or DEFAULT_ROWS) * SCAN_FACTOR
    rows: list[list[int]] = []
    cols = list(spec.input.columns())
    for unit in plan.units:
        rendered = render(spec, plan.source.read(unit, cols), plan.tokenizer)
        rows += [ids for ids, err in zip(rendered.token_ids, rendered.errors) if err is None and ids]
        if len(rows) >= want:
            break
    return rows[:want]
