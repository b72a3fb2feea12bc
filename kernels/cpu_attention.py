"""Paged attention on CPU that reads K/V blocks where they lie: a small torch C++ op, built at first use.

paged_attention(q [T, Hq, D], k_cache, v_cache [N, bs, Hkv, D], query_start_loc [B+1] int32, seq_lens [B] int32,
block_tables [B, max_blocks] int32, scale, sliding_window) -> [T, Hq, D]. Sequence b's queries are rows
query_start_loc[b]:query_start_loc[b+1] of q, the last qlen positions of its seq_lens[b]-token context
(causal offset seq_lens[b] - qlen); GQA when Hq is a multiple of Hkv; optional sliding window; float
accumulation and online softmax; cost follows the sum of the contexts, and no K/V is copied.
The caches may be float8 (kv_cache_dtype fp8: kernels/kv_quant.py) whatever q's dtype, read as value x k_scale /
v_scale and converted in registers (no dequantised copy), or int8 rows [N, bs, Hkv, D + 2 ceil(D / 32)] of
codes and float16 group scales (kv_cache_dtype int8); store_kv quantises as kv_quant.quantize /
quantize_int8 do. The VDPBF16PS paths below read quantized rows converted to bfloat16 a tile ahead.
paged_attention_ref is the same contract in plain torch (gather, mask, softmax), the op's reference.
On AVX-512 BF16 CPUs, bfloat16 items with head_dim 64 or 128 run on VDPBF16PS (isa "avx512_bf16"; "avx512" caps
a call to the generic loops, which tests compare it with): decode and verification (at most 8 query rows per
KV head) score keys on K tiles transposed in registers; prefill chunks (more rows) also run p @ V on it, with p
rounded to bfloat16 for that product as torch's CPU flash attention does.

The source (csrc/cpu_attention.cpp, with csrc/cpu_kv_store.cpp, csrc/cpu_layer_ops.cpp and the rest: one library) is compiled once per machine with torch.utils.cpp_extension and cached
under $BATCHRUN_EXTENSIONS_DIR, else $XDG_CACHE_HOME/batchrun/torch_extensions, else
~/.cache/batchrun/torch_extensions, in a folder keyed by the source, the flags, torch and Python. The build
is portable (no -march=native: the kernel is compiled for AVX-512, AVX2 and the baseline and picks one at run
time), so a cache that moves to another machine stays valid. Concurrent first uses (pytest and a job, Ray
actors) build once: builders serialise on a file lock that dies with its process. If the op cannot be
built or loaded, load() logs one warning and returns False, and callers keep their torch path.
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import torch

from .kv_quant import dequantize

log = logging.getLogger(__name__)

NAME = "batchrun_cpu_attention"
CSRC = Path(__file__).resolve().parent / "csrc"
SOURCE = CSRC / "cpu_attention.cpp"
# one library: the attention op and its K/V store, the layer's elementwise ops (cpu_layer_ops.py), the bf16 projection
# (cpu_gemm.py), the whole layer composed of them (cpu_decoder_layer.py), greedy argmax (cpu_argmax.py)
# and their shared headers
EXTRA_SOURCES = [CSRC / "cpu_attention_sdpa.cpp", CSRC / "cpu_layer_ops.cpp", CSRC / "cpu_gemm.cpp",
                 CSRC / "cpu_gemm_avx2.cpp", CSRC / "cpu_decoder_layer.cpp", CSRC / "cpu_argmax.cpp",
                 CSRC / "cpu_w8a8.cpp", CSRC / "cpu_kv_store.cpp"]
HEADERS = [CSRC / "vec.h", CSRC / "ops.h", CSRC / "cpu_gemm_avx2.h", CSRC / "cpu_attention_bf16.h",
           CSRC / "cpu_attention_bf16_prefill.h", CSRC / "cpu_w8a8_quantize.h"]
# -O2: the hot loops use explicit vector types, so -O3 buys nothing here but triples the build time.
# No -march: the source compiles its kernel for several ISAs and picks one at run time. Threads come from
# torch's own pool (stable parallel_for), so no OpenMP flags.
_CFLAGS = ["-O2", "-Wno-psabi"]
_LDFLAGS: list = []
ISAS = {0: "baseline", 1: "avx2", 2: "avx512", 3: "avx512_bf16"}  # 3: paged_attention's bfloat16 path only

_lock = threading.Lock()
_state: dict = {"tried": False, "ok": False, "error": None, "build_s": None, "path": None}


def cache_root() -> Path:
    env = os.environ.get("BATCHRUN_EXTENSIONS_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "batchrun" / "torch_extensions"


def build_dir() -> Path:
    """This build's folder: keyed by everything that makes the binary (source, flags, torch, Python, ABI)."""
    h = hashlib.sha256()
    for f in [SOURCE, *EXTRA_SOURCES, *HEADERS]:
        h.update(f.read_bytes())
    for part in (_CFLAGS, _LDFLAGS, torch.__version__, torch.compiled_with_cxx11_abi(), sys.version_info[:2],
                 platform.machine(), sys.platform):
        h.update(repr(part).encode())
    return cache_root() / f"{NAME}-{h.hexdigest()[:16]}"


def _library_file(d: Path) -> Path:
    return d / (f"{NAME}.pyd" if sys.platform == "win32" else f"{NAME}.so")


def _build(d: Path) -> None:
    from torch.utils import cpp_extension
    d.mkdir(parents=True, exist_ok=True)
    done = d / "built"
    lock_file = None
    try:
        try:
            import fcntl
            lock_file = open(d / "build.flock", "w")
            fcntl.flock(lock_file, fcntl.LOCK_EX)      # released by the OS if this process dies mid-build
            # torch's own baton file is left behind by a killed builder and would make every later build
            # wait forever; holding the flock, nobody else is building, so one found now is stale
            stale = d / "lock"
            if stale.exists():
                stale.unlink()
        except ImportError:                            # no fcntl (Windows): torch's baton alone
            pass
        if done.exists():                              # built by another process while we waited
            torch.ops.load_library(str(_library_file(d)))
            return
        t0 = time.perf_counter()
        log.info("building the CPU attention op in %s (once per machine)", d)
        cpp_extension.load(name=NAME, sources=[str(f) for f in [SOURCE, *EXTRA_SOURCES]], extra_cflags=_CFLAGS, extra_ldflags=_LDFLAGS,
                           build_directory=str(d), is_python_module=False, verbose=False)
        _state["build_s"] = time.perf_counter() - t0
        log.info("built the CPU attention op in %.1f s", _state["build_s"])
        done.write_text(f"{torch.__version__}\n")
    finally:
        if lock_file is not None:
            lock_file.close()


def load() -> bool:
    """Build (first use on this machine) and load the op; False, after one warning, if that fails."""
    with _lock:
        if _state["tried"]:
            return _state["ok"]
        _state["tried"] = True
        try:
            d = build_dir()
            _state["path"] = str(_library_file(d))
            if (d / "built").exists():
                torch.ops.load_library(str(_library_file(d)))
            else:
                _build(d)
            torch.ops.batchrun_cpu.paged_attention      # registered?
            _register_fake()
            _state["ok"] = True
        except Exception as e:                          # no compiler, no ninja, a compile error...
            msg = " ".join(str(e).split())
            _state["error"] = f"{type(e).__name__}: {msg[:300]}"
            log.warning("batchrun: CPU attention op unavailable (%s); using the slower torch attention path",
                        _state["error"])
        return _state["ok"]


def status() -> dict:
    """What load() did: tried, ok, error, build_s (None unless this process built it), path."""
    return dict(_state)


def _register_fake() -> None:
    # shape functions, so torch.compile can trace through a graph that calls the ops
    try:
        @torch.library.register_fake("batchrun_cpu::paged_attention")
        def _(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, sliding_window, isa=-1,
              k_scale=1.0, v_scale=1.0, sdpa_from=-1):
            return q.new_empty(q.shape)

        @torch.library.register_fake("batchrun_cpu::store_kv")
        def _(k, v, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0):
            return None

        @torch.library.register_fake("batchrun_cpu::rms_norm")
        def _(x, w, eps):
            return x.new_empty(x.shape)

        @torch.library.register_fake("batchrun_cpu::add_rms_norm")
        def _(x, residual, w, eps):
            return x.new_empty(x.shape)

        @torch.library.register_fake("batchrun_cpu::rope_")
        def _(q, k, cos_sin, positions):
            return None

        @torch.library.register_fake("batchrun_cpu::decoder_layer")
        def _(h, *args):
            return None

        @torch.library.register_fake("batchrun_cpu::bf16_linear")
        def _(x, wp, n):
            return x.new_empty((x.shape[0], n))

        @torch.library.register_fake("batchrun_cpu::silu_mul")
        def _(gate_up):
            return gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))
    except Exception:                                   # already registered (a second load), or an old torch
        pass


def cpu_isa() -> str:
    """The instruction set the op runs with on this machine: avx512, avx2 or baseline."""
    if not load():
        raise RuntimeError(f"CPU attention op unavailable: {_state['error']}")
    return ISAS[int(torch.ops.batchrun_cpu.cpu_isa())]


def attention_isa() -> str:
    """The best level paged_attention runs at here: cpu_isa(), or avx512_bf16 where the CPU has AVX-512 BF16
    (bfloat16 items with head_dim 64 or 128 then take the VDPBF16PS paths)."""
    if not load():
        raise RuntimeError(f"CPU attention op unavailable: {_state['error']}")
    return ISAS[int(torch.ops.batchrun_cpu.attention_isa())]


def set_kv_prefetch(tiles: int) -> int:
    """How many 16-key tiles ahead a decode step prefetches a bfloat16 cache on the VDPBF16PS path: 2 (the
    default) or 1 (the next tile only; benchmarks compare the two). Returns the previous value."""
    if not load():
        raise RuntimeError(f"CPU attention op unavailable: {_state['error']}")
    return int(torch.ops.batchrun_cpu.set_kv_prefetch(int(tiles)))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                    sliding_window: Optional[int] = None, *, isa: Optional[str] = None, k_scale: float = 1.0,
                    v_scale: float = 1.0, sdpa_from: Optional[int] = None) -> torch.Tensor:
    """The compiled op (see the module docstring). isa: force a lower instruction set (tests); None = best.
    k_scale, v_scale: float8 caches only. sdpa_from: sequences whose queries are their whole context (a fresh
    prompt chunk) and number at least this many run through torch's scaled_dot_product_attention instead of
    the own kernel (no sliding window, K/V in q's dtype; csrc/cpu_attention_sdpa.cpp); None: never."""
    if not load():
        raise RuntimeError(f"CPU attention op unavailable: {_state['error']}")
    level = -1 if isa is None else {v: k for k, v in ISAS.items()}[isa]
    return torch.ops.batchrun_cpu.paged_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables,
                                                  float(scale), -1 if sliding_window is None else int(sliding_window),
                                                  level, float(k_scale), float(v_scale),
                                                  -1 if sdpa_from is None else int(sdpa_from))


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """k, v [T, Hkv, D] into k_cache, v_cache [N, bs, Hkv, D] at slot_mapping [T] int64 (block * bs + offset;
    negative: padding, skipped), in one call; k and v may be strided views (of the qkv projection). Float8
    caches get kv_quant.quantize(k, dtype, k_scale) (and v's), int8 caches kv_quant.quantize_int8(k), bit for
    bit."""
    if not load():
        raise RuntimeError(f"CPU attention op unavailable: {_state['error']}")
    torch.ops.batchrun_cpu.store_kv(k, v, k_cache, v_cache, slot_mapping, float(k_scale), float(v_scale))


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                        scale: float, sliding_window: Optional[int] = None, k_scale: float = 1.0,
                        v_scale: float = 1.0) -> torch.Tensor:
    """paged_attention in plain torch, one sequence at a time: gather its blocks (float8 ones dequantised:
    float(code) x scale), mask, float softmax."""
    T, Hq, D = q.shape
    bs, Hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros_like(q)
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    for b, ctx in enumerate(lens):
        start, end = qsl[b], qsl[b + 1]
        ql = end - start
        if ql == 0:
            continue
        blocks = block_tables[b, :-(-ctx // bs)].long()
        k = dequantize(k_cache[blocks].flatten(0, 1)[:ctx], k_scale).repeat_interleave(Hq // Hkv, 1)  # [ctx, Hq, D]
        v = dequantize(v_cache[blocks].flatten(0, 1)[:ctx], v_scale).repeat_interleave(Hq // Hkv, 1)
        s = torch.einsum("qhd,khd->hqk", q[start:end].float(), k) * scale
        qpos = torch.arange(ctx - ql, ctx)[:, None]
        kpos = torch.arange(ctx)[None, :]
        visible = kpos <= qpos
        if sliding_window is not None:
            visible &= qpos - kpos < sliding_window
        s = s.masked_fill(~visible, float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).to(q.dtype)
    return out
