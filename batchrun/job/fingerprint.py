"""A job's fingerprint: the identity of its results (model, sampling, prompt, input, units, output schema).

The ledger stores it in the manifest; a submit resumes into an output only when it is unchanged.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import TYPE_CHECKING, Any, Optional

from batchrun.connectors import Source
from batchrun.engine.config import W8A8_DEFAULT_GROUP, quantization_group
from batchrun.job.schema import JobSpec

if TYPE_CHECKING:
    from batchrun.models.loader import ModelInfo

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json")


def _sha256_file(path: str) -> Optional[str]:
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except FileNotFoundError:
        return None


def _quantization_fp(spec: JobSpec) -> dict[str, Any]:
    """Quantization (of the weights, of the KV cache) changes the outputs as dtype does; only when set, so
    unquantized manifests stay valid. The KV cache as its torch dtype: "fp8" and "fp8_e4m3" are one format."""
    e = spec.engine
    kv = {}
    if e.kv_cache_dtype != "auto":
        from batchrun.kernels.kv_quant import KV_CACHE_DTYPES    # torch: only for a quantised KV cache
        kv = {"kv_cache_dtype": str(KV_CACHE_DTYPES[e.kv_cache_dtype]).removeprefix("torch.")}
    if e.quantization_calibration is not None:      # its rows set w8a8's and fp8 KV's scales
        kv["quantization_calibration"] = e.quantization_calibration
    if e.quantization is None:
        return kv
    group = quantization_group(e.quantization, e.quantization_group_size)
    return {"quantization": e.quantization, "quantize_lm_head": e.quantize_lm_head,
            **({"quantization_group_size": group} if _group_counts(e.quantization, group) else {}), **kv}


def _group_counts(quantization: str, group: int) -> bool:
    """int4's group always; w8a8's where it is not the default, which its fingerprints always implied."""
    return quantization == "int4" or (quantization == "w8a8" and group != W8A8_DEFAULT_GROUP)


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
        # 2: the `shared` column; 3: `sample_index` and the logprob columns. Older outputs are not resumed into
        "output_schema": 3,
        # only when set, so the manifests of unpartitioned jobs stay valid
        **({"output": {"partition_by": spec.output.partition_by}} if spec.output.partition_by else {}),
    }


def fingerprint_hash(fp: dict) -> str:
    return hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:16]
