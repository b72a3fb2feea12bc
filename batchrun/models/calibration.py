"""The calibration pass (quantization_calibration): activation statistics of the float model over some rows.

The loaded float/bf16 model runs forward (prefill only) over token rows: the job's own first prompts, a file's,
or, for an engine given neither, the stdlib docstrings the demo uses. It records, per projection, the absmax of
each input channel (SmoothQuant's max|X_j|, models/smoothquant.py), and per layer the absmax of K (after RoPE,
what the cache stores) and of V (fp8 KV scales). The model's own forward runs: each projection's weight is
wrapped for the pass by a recorder (cpu_linear.linear hands it x), and attention is a small causal SDPA backend
that records K and V. Statistics are cached by model and input fingerprint in $BATCHRUN_CALIBRATION_CACHE
(default ~/.cache/batchrun/calibration; "0": no cache).
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Optional, Union

import torch
from torch import nn

from batchrun.models.cpu_linear import linear
from batchrun.models.gptq import block_gram

KNOB = "quantization_calibration"
DEFAULT_ROWS = 256
MAX_ROW_TOKENS = 512          # a longer row is cut: its first tokens carry the statistics all the same
CHUNK_TOKENS = 2048           # rows are run this many tokens at a time, as one flat batch
CACHE_ENV = "BATCHRUN_CALIBRATION_CACHE"
TEXT_KEYS = ("prompt", "text", "input")


def cache_dir() -> Optional[str]:
    v = os.environ.get(CACHE_ENV, "")
    if v == "0":
        return None
    return v or os.path.join(os.path.expanduser("~"), ".cache", "batchrun", "calibration")


def read_prompts(path: str) -> list[str]:
    """A calibration file's prompts: JSONL (a "prompt"/"text"/"input" field, or a string per line), Parquet
    (the first of those columns) or plain text (a prompt per line). Raises ValueError naming the knob."""
    if not os.path.isfile(path):
        raise ValueError(f"{KNOB}: no such file {path!r}")
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq
        table = pq.read_table(path)
        col = next((c for c in TEXT_KEYS if c in table.column_names), None)
        if col is None:
            raise ValueError(f"{KNOB}: {path} has none of the columns {', '.join(TEXT_KEYS)}")
        rows = [r for r in table.column(col).to_pylist() if isinstance(r, str)]
    else:
        with open(path, encoding="utf-8") as f:
            lines = [ln.strip() for ln in f if ln.strip()]
        if path.endswith((".jsonl", ".json")):
            rows = []
            for ln in lines:
                try:
                    v = json.loads(ln)
                except json.JSONDecodeError:
                    raise ValueError(f"{KNOB}: {path}: a line is not JSON: {ln[:60]!r}") from None
                v = next((v.get(k) for k in TEXT_KEYS if isinstance(v, dict) and k in v), v)
                if isinstance(v, str):
                    rows.append(v)
        else:
            rows = lines
    rows = [r for r in rows if r.strip()]
    if not rows:
        raise ValueError(f"{KNOB}: {path} has no usable rows (non-empty prompts)")
    return rows


def pick_rows(rows: list[list[int]], n: int) -> list[list[int]]:
    """At most n non-empty rows, the long ones included: the longest half of n first, then the rest in order."""
    rows = [r for r in rows if r]
    if len(rows) <= n:
        return rows
    longest = set(sorted(range(len(rows)), key=lambda i: -len(rows[i]))[: n // 2])
    rest = [i for i in range(len(rows)) if i not in longest][: n - len(longest)]
    return [rows[i] for i in sorted(longest | set(rest))]


def resolve_rows(setting: Union[int, str, None], tokenize, job_rows: Optional[list[list[int]]] = None):
    """The token rows the pass runs on: `setting` an int N (None: DEFAULT_ROWS) takes N of job_rows (the job's
    prompts), or of the stdlib docstrings when there are none; a str is a file's prompts (read_prompts).
    tokenize: str -> token ids. Raises ValueError naming the knob when no row is usable."""
    if isinstance(setting, str):
        return pick_rows([tokenize(p) for p in read_prompts(setting)], DEFAULT_ROWS)
    n = DEFAULT_ROWS if setting is None else setting
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{KNOB}: a row count >= 1 or a file path, got {setting!r}")
    if job_rows is None:
        from batchrun.demo_docstrings import stdlib_paragraphs
        job_rows = [tokenize(p["text"]) for p in stdlib_paragraphs(n)]
    rows = pick_rows(job_rows, n)
    if not rows:
        raise ValueError(f"{KNOB}: no usable rows (every prompt is empty)")
    return rows


class _Recorder:
    """Stands in for a projection's weight during the pass: records each input channel's absmax, and with
    `gram` (a dict) the diagonal blocks of x^T x (models/gptq.py)."""

    def __init__(self, w: torch.Tensor, stats: dict, name: str, gram: Optional[dict] = None):
        self.w, self.stats, self.name, self.gram = w, stats, name, gram

    def linear(self, x: torch.Tensor, b: Optional[torch.Tensor] = None) -> torch.Tensor:
        x2 = x.detach().reshape(-1, x.shape[-1])
        a = x2.abs().amax(0).float()
        old = self.stats.get(self.name)
        self.stats[self.name] = a if old is None else torch.maximum(old, a)
        if self.gram is not None:
            g = block_gram(x2)
            self.gram[self.name] = g if self.name not in self.gram else self.gram[self.name].add_(g)
        return linear(x, self.w, b)


class _CausalBackend:
    """The pass's attention: causal SDPA within each row of the flat batch; records |K| and |V| per layer."""

    name = "calibration"

    def __init__(self, num_layers: int):
        self.k_absmax, self.v_absmax = [0.0] * num_layers, [0.0] * num_layers
        self.lengths: list[int] = []
        self.layer, self.num_layers = 0, num_layers

    def store_kv(self, k, v, k_cache, v_cache, meta, k_scale, v_scale):
        i = self.layer
        self.k_absmax[i] = max(self.k_absmax[i], k.abs().max().item())
        self.v_absmax[i] = max(self.v_absmax[i], v.abs().max().item())
        self._kv = (k, v)

    def forward(self, q, k_cache, v_cache, meta, scale, sliding_window, k_scale, v_scale):
        k, v = self._kv
        rep = q.shape[1] // k.shape[1]
        out, start = [], 0
        for n in self.lengths:
            qs, ks, vs = (t[start:start + n].transpose(0, 1) for t in (q, k, v))    # [heads, n, D]
            ks, vs = ks.repeat_interleave(rep, 0), vs.repeat_interleave(rep, 0)
            mask = torch.ones(n, n, dtype=torch.bool).tril()
            if sliding_window:
                mask &= ~torch.ones(n, n, dtype=torch.bool).tril(-sliding_window)
            o = nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)
            out.append(o.transpose(0, 1))
            start += n
        self.layer = (self.layer + 1) % self.num_layers
        return torch.cat(out)


def projections(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """(name, module) of every projection (not lm_head) whose weight is still a plain tensor."""
    return [(n, m) for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and n != "lm_head" and isinstance(m.weight, torch.Tensor)]


def cut_rows(model: nn.Module, rows: list[list[int]]) -> list[list[int]]:
    """Each row's first MAX_ROW_TOKENS tokens, and no more than the model has positions for (max_model_len)."""
    table = getattr(model, "cos_sin", None)
    limit = MAX_ROW_TOKENS if table is None else min(MAX_ROW_TOKENS, table.shape[0])
    return [r[:limit] for r in rows]


@torch.inference_mode()
def collect_stats(model: nn.Module, rows: list[list[int]], gram: bool = False) -> dict:
    """Run the model over `rows`; returns {"act_absmax": {projection: [K] float32}, "k_absmax": [L],
    "v_absmax": [L], "rows": n, "tokens": n}, and with gram "gram": {projection: x^T x's diagonal blocks}."""
    stats: dict = {}
    grams: Optional[dict] = {} if gram else None
    mods = projections(model)
    params = {n: m.weight for n, m in mods}
    for n, m in mods:
        del m._parameters["weight"]
        m.weight = _Recorder(params[n], stats, n, grams)
    backend = _CausalBackend(len(model.layers))
    dummy_kv = torch.zeros(len(model.layers), 2, 1)
    rows = cut_rows(model, rows)
    try:
        batch: list[list[int]] = []
        for i, r in enumerate(rows):
            batch.append(r)
            if sum(map(len, batch)) >= CHUNK_TOKENS or i == len(rows) - 1:
                ids = torch.tensor([t for b in batch for t in b])
                pos = torch.cat([torch.arange(len(b)) for b in batch])
                backend.lengths = [len(b) for b in batch]
                model(ids, pos, dummy_kv, None, backend)
                batch = []
    finally:
        for n, m in mods:
            del m.weight
            m.register_parameter("weight", params[n])
    out = {"act_absmax": stats, "k_absmax": backend.k_absmax, "v_absmax": backend.v_absmax,
           "rows": len(rows), "tokens": sum(map(len, rows))}
    return out if grams is None else {**out, "gram": grams}


def fingerprint(model_id: str, dtype: torch.dtype, rows: list[list[int]]) -> str:
    """The cache key: the model's identity (path, weight files' sizes and times), dtype and the rows."""
    h = hashlib.sha256(json.dumps([model_id, str(dtype)]).encode())
    for r in rows:
        h.update(json.dumps(r).encode())
    return h.hexdigest()[:32]


def model_identity(info) -> str:
    files = [info.path] if os.path.isfile(info.path) else list(getattr(info, "weight_files", []))
    return json.dumps([os.path.abspath(info.path)] + [[f, os.path.getsize(f), os.path.getmtime(f)] for f in files])


def calibrate(model: nn.Module, info, rows: list[list[int]], gram: bool = False) -> dict:
    """collect_stats, read from / written to the cache when one is set (stats["cached"] says which); a cached
    file without the Hessian blocks that `gram` asks for is recomputed (and rewritten with them)."""
    d = cache_dir()
    rows = cut_rows(model, rows)
    key = fingerprint(model_identity(info), model.embed_tokens.weight.dtype, rows)
    path = os.path.join(d, f"{key}.pt") if d else None
    if path and os.path.isfile(path):
        try:
            stats = torch.load(path, weights_only=True)
            if "gram" in stats or not gram:
                return {**stats, "cached": True, "cache_path": path}
        except (OSError, RuntimeError, EOFError):        # a torn or foreign file: recompute, rewrite
            pass
    stats = collect_stats(model, rows, gram)
    if path:
        os.makedirs(d, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        torch.save(stats, tmp)
        os.replace(tmp, path)
    return {**stats, "cached": False, "cache_path": path}


def needs_calibration(config) -> bool:
    """W8A8 always calibrates; an fp8 KV cache when quantization_calibration is set (else its scales stay 1.0)."""
    return config.quantization == "w8a8" or (config.kv_cache_dtype.startswith("fp8")
                                              and config.quantization_calibration is not None)
