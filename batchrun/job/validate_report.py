"""What `batchrun validate` prints: the plan's files, units and rows, prompt lengths from a sample, the memory
ledger (no weights load) and what a submit would do with the output.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from batchrun.engine.config import quantization_group
from batchrun.job.render import render
from batchrun.job.schema import JobSpec

if TYPE_CHECKING:
    from batchrun.job.plan import JobPlan


def _kv_budget_estimate(spec: JobSpec, weights_bytes: int, kv_bytes_per_token: int,
                        max_len: int) -> tuple[Optional[int], str]:
    """What the engine will size its KV cache to (engine.kv_memory.kv_budget), without loading it."""
    if spec.engine.kv_cache_memory is not None:
        return int(spec.engine.kv_cache_memory), "engine.kv_cache_memory"
    import torch
    if spec.engine.device in ("auto", "cuda") and torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        return int(spec.engine.gpu_memory_utilization * total - weights_bytes), \
            "estimate: gpu_memory_utilization x GPU memory - weights (activations are profiled at load)"
    from batchrun.engine.config import DEVICE_DEFAULTS
    from batchrun.engine.kv_cache import blocks_needed
    from batchrun.engine.kv_memory import available_host_memory
    seqs = spec.engine.max_num_seqs or DEVICE_DEFAULTS["cpu"]["max_num_seqs"]
    bs = spec.engine.block_size
    useful = seqs * blocks_needed(max_len, bs) * bs * kv_bytes_per_token
    half = int(0.5 * available_host_memory())
    return min(useful, half), (f"max_num_seqs {seqs} x max_model_len {max_len}" if useful <= half
                               else "half the available RAM") + "; pages touched only as used"


def _cpu_gemm(spec: JobSpec, info, dtype) -> dict[str, Any]:
    """Which implementation will run the bf16 projections (models/kernel_choice.py), without loading weights:
    a forced form, auto's choice cached by an earlier start on this machine, or "measured at start"; and how
    the own kernel's few-row products load the weights (models/weight_loads.py), the same three ways."""
    import torch
    from batchrun.engine.config import default_threads
    from batchrun.engine.runner import resolve_device
    from batchrun.models import kernel_choice
    from batchrun.models.llama import LlamaModel
    e = spec.engine
    mode = kernel_choice.resolve_mode(e.cpu_gemm)
    if resolve_device(e.device).type != "cpu" or dtype != torch.bfloat16 or e.compile or e.tensor_parallel_size > 1:
        return {"mode": mode, "choice": None, "note": "fixed path (bf16 on CPU, eager, one rank measures)"}
    from batchrun.kernels import cpu_attention
    from batchrun.models import weight_loads
    with torch.device("meta"):
        model = LlamaModel(info.args, 8, device=torch.device("meta"))
    threads = e.threads or default_threads()
    built = (cpu_attention.build_dir() / "built").exists()
    loads_mode = weight_loads.resolve_mode()
    if loads_mode != "auto":
        loads = f"{loads_mode} (forced)"
    else:
        cached = weight_loads.cached_mode(model, threads) if built else None
        loads = f"{cached} (cached)" if cached else "measured at engine start"
    if mode != "auto":
        return {"mode": mode, "choice": None, "note": f"forced: {mode} wherever it can hold the weight",
                "weight_loads": loads}
    choice = kernel_choice.cached_choice(kernel_choice.projection_shapes(model), threads) if built else None
    note = "cached from an earlier start on this machine" if choice else "measured at engine start (under a second)"
    return {"mode": mode, "choice": choice, "weight_loads": loads,
            "note": note + ("" if not e.quantization else "; quantized layers run their own kernels")}


def _cpu_attention(spec: JobSpec, info, dtype, max_len: int) -> dict[str, Any]:
    """Which implementation will run CPU attention (models/attention_choice.py), without loading weights:
    forced, float32's fixed path, auto's choice cached by an earlier start here, or "measured at start"."""
    import torch
    from batchrun.engine.config import default_threads
    from batchrun.engine.runner import resolve_device
    from batchrun.models import attention_choice
    e = spec.engine
    mode = attention_choice.resolve_mode(e.cpu_attention)
    if resolve_device(e.device).type != "cpu" or e.attention_backend == "triton":
        return {"mode": mode, "report": None, "note": "not CPU attention"}
    if mode != "auto" or dtype == torch.float32:
        r = attention_choice.choose((1, 1, 1), dtype, mode, 1, max_len)    # forced: no measuring
        return {"mode": mode, "report": r, "note": "forced" if mode != "auto" else "float32: the own kernel"}
    from batchrun.models.tp import shard_args
    a = shard_args(info.args, e.tensor_parallel_size)          # one rank's heads
    heads = (a.num_heads, a.num_kv_heads, a.head_dim)
    longest = min(max_len, e.max_num_batched_tokens or max_len)
    r = attention_choice.cached_choice(heads, dtype, e.threads or default_threads(), longest)
    return {"mode": mode, "report": r, "note": "cached from an earlier start on this machine" if r
            else "measured at engine start (well under a second)"}


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
    from batchrun.kernels.kv_quant import kv_dtype
    from batchrun.models.quant import weight_bytes_after
    e = spec.engine
    kv_type = kv_dtype(e.kv_cache_dtype, dtype)
    kvb = info.kv_bytes_per_token(kv_type)              # the real bytes: half of bf16's with a float8 cache
    group = quantization_group(e.quantization, e.quantization_group_size)
    memory, quantized = weight_bytes_after(info, e.quantization, group, e.quantize_lm_head,
                                           dtype)      # quantized layers counted as their codes and scales
    budget, how = _kv_budget_estimate(spec, memory, kvb, max_len)
    kv_tokens = None if budget is None else budget // kvb
    # on disk: the file's own tensor types (F32, BF16, Q4_1, ...); in memory: every parameter in `dtype`, but
    # quantized layers (engine.quantization) as their codes and scales
    ledger = {"architecture": info.architecture, "format": info.format, "num_params": info.num_params,
              "weights_bytes": info.weights_bytes,
              "weights_on_disk": {k: {"tensors": n, "bytes": b} for k, (n, b) in
                                  sorted(info.tensor_types.items(), key=lambda kv: -kv[1][1])},
              "weights_memory_bytes": memory, "dtype": str(dtype).replace("torch.", ""),
              "quantization": e.quantization, "quantized_bytes": quantized,
              "kv_cache_dtype": str(kv_type).replace("torch.", ""), "kv_bytes_per_token": kvb,
              "max_model_len": max_len, "kv_cache_bytes": budget, "kv_budget": how,
              "kv_tokens": kv_tokens,
              "max_concurrency_at_max_model_len": None if kv_tokens is None else round(kv_tokens / max_len, 2),
              "max_num_seqs": spec.engine.max_num_seqs or "device default",
              "cpu_gemm": _cpu_gemm(spec, info, dtype),
              "cpu_attention": _cpu_attention(spec, info, dtype, max_len)}
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
              + (f"({m['num_params'] / 1e6:.2f}M params x {m['dtype']})" if not m["quantization"] else
                 f"({m['quantization']}: {mib(m['quantized_bytes'])} quantized layers, the rest {m['dtype']})")]
    lines += [f"          {kind:<5} {t['tensors']:>5} tensor{'s' if t['tensors'] != 1 else ' '} {mib(t['bytes']):>12}"
              for kind, t in m["weights_on_disk"].items()]
    lines += [f"memory  KV {m['kv_bytes_per_token']} B/token ({m['kv_cache_dtype']}); cache {mib(m['kv_cache_bytes'])} ({m['kv_budget']})"
              f" = {m['kv_tokens']} tokens = {m['max_concurrency_at_max_model_len']} sequences at max_model_len; "
              f"max_num_seqs {m['max_num_seqs']}",
              f"gemm    cpu_gemm {m['cpu_gemm']['mode']}: {m['cpu_gemm']['note']}"
              + (f"; weight loads at few rows {m['cpu_gemm']['weight_loads']}" if "weight_loads" in m["cpu_gemm"] else "")]
    lines += [f"          {shape:<10} {forms}" for shape, forms in (m["cpu_gemm"]["choice"] or {}).items()]
    att = m["cpu_attention"]
    lines += [f"attn    cpu_attention {att['mode']}: {att['note']}"
              + (f"; prefill {att['report']['prefill']}, decode {att['report']['decode']}" if att["report"] else "")]
    lines += [f"output  {r['output']['uri']}: {r['output']['state']}"]
    return "\n".join(lines)
