"""Build and run llama.cpp for the peer benchmarks (scripts/bench_peers.py).

The source is the llama.cpp tree vendored in llama-cpp-python's source distribution (PyPI is the one
index this project can reach). Built once, CPU only, into a cache:

    ~/.cache/batchrun/llama.cpp/llama_cpp_python-<v>/vendor/llama.cpp   the source
    ~/.cache/batchrun/llama.cpp/build/bin/llama-batched-bench           the binaries

    python scripts/llamacpp.py build                 # download + build (skipped when the binary exists)
    python scripts/llamacpp.py convert HF_DIR OUT.gguf [--outtype bf16]

Nothing here imports torch; the helpers raise LlamaCppError with a one-line reason on any failure.
"""
from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
import tarfile
from typing import Optional

CACHE = os.environ.get("BATCHRUN_LLAMACPP_CACHE", os.path.expanduser("~/.cache/batchrun/llama.cpp"))
PACKAGE = "llama-cpp-python"
VERSION = os.environ.get("BATCHRUN_LLAMACPP_PY_VERSION", "0.3.36")   # vendors ggml 0.25.3
TARGETS = ("llama-batched-bench",)


class LlamaCppError(RuntimeError):
    """A step of fetching, building, converting or running llama.cpp failed; str() is one line."""


def _run(cmd: list[str], log: Optional[str] = None, timeout: Optional[float] = None, **kw) -> str:
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=timeout, **kw)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise LlamaCppError(f"{os.path.basename(cmd[0])}: {e}") from e
    if log:
        with open(log, "a") as f:
            f.write(f"$ {' '.join(cmd)}\n{p.stdout}\n")
    if p.returncode != 0:
        tail = " | ".join(p.stdout.strip().splitlines()[-3:])
        raise LlamaCppError(f"{os.path.basename(cmd[0])} exited {p.returncode}"
                            + (f" (log: {log})" if log else "") + f": {tail[-400:]}")
    return p.stdout


def source_dir(cache: str = CACHE) -> str:
    """The vendored llama.cpp tree, downloading and unpacking the sdist when it is not there yet."""
    src = os.path.join(cache, f"llama_cpp_python-{VERSION}", "vendor", "llama.cpp")
    if os.path.isfile(os.path.join(src, "CMakeLists.txt")):
        return src
    os.makedirs(cache, exist_ok=True)
    sdist_dir = os.path.join(cache, "sdist")
    tarballs = glob.glob(os.path.join(sdist_dir, f"llama_cpp_python-{VERSION}.tar.gz"))
    if not tarballs:
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
              f"{PACKAGE}=={VERSION}", "-d", sdist_dir], log=os.path.join(cache, "download.log"), timeout=900)
        tarballs = glob.glob(os.path.join(sdist_dir, f"llama_cpp_python-{VERSION}.tar.gz"))
        if not tarballs:
            raise LlamaCppError(f"pip download left no llama_cpp_python-{VERSION}.tar.gz in {sdist_dir}")
    with tarfile.open(tarballs[0]) as tf:
        tf.extractall(cache, filter="data") if hasattr(tarfile, "data_filter") else tf.extractall(cache)
    if not os.path.isfile(os.path.join(src, "CMakeLists.txt")):
        raise LlamaCppError(f"{tarballs[0]} has no vendor/llama.cpp")
    return src


def binary(name: str, cache: str = CACHE) -> str:
    return os.path.join(cache, "build", "bin", name)


def ensure_built(targets=TARGETS, cache: str = CACHE, jobs: int = 2) -> dict[str, str]:
    """{target: path of its binary}; configures and builds only what is missing (Release, CPU, no CURL)."""
    missing = [t for t in targets if not os.access(binary(t, cache), os.X_OK)]
    if missing:
        src = source_dir(cache)
        build = os.path.join(cache, "build")
        log = os.path.join(cache, "build.log")
        if not os.path.isfile(os.path.join(build, "CMakeCache.txt")):
            gen = ["-G", "Ninja"] if _which("ninja") else []
            _run(["cmake", "-S", src, "-B", build, *gen, "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
                  "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DGGML_CUDA=OFF", "-DGGML_METAL=OFF",
                  "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF"], log=log, timeout=600)
        _run(["cmake", "--build", build, "--target", *missing, f"-j{jobs}"], log=log, timeout=3600)
    out = {t: binary(t, cache) for t in targets}
    for t, p in out.items():
        if not os.access(p, os.X_OK):
            raise LlamaCppError(f"build finished but {p} is missing")
    return out


def _which(name: str) -> Optional[str]:
    from shutil import which
    return which(name)


# Run the tree's converter in-process with two fallbacks for a random-init model whose tokenizer only
# exists to satisfy loaders (batchrun.demo.build_tokenizer: a byte-level BPE no hash table knows):
# no tokenizer.model means "not sentencepiece" (the tree imports sentencepiece before looking), and an
# unrecognised BPE pre-tokenizer is written as "gpt-2". Real tokenizers take the tree's own path.
_CONVERT_BOOTSTRAP = """
import runpy, sys
src = sys.argv[1]
sys.path[:0] = [src, src + '/gguf-py']
from conversion import base
_pre, _sp = base.TextModel.get_vocab_base_pre, base.TextModel._set_vocab_sentencepiece
def get_vocab_base_pre(self, tokenizer):
    try:
        return _pre(self, tokenizer)
    except NotImplementedError:
        print('convert: unrecognised BPE pre-tokenizer, written as gpt-2', file=sys.stderr)
        return 'gpt-2'
def _set_vocab_sentencepiece(self, *a, **k):
    if not (self.dir_model / 'tokenizer.model').is_file():
        raise FileNotFoundError('no tokenizer.model')
    return _sp(self, *a, **k)
base.TextModel.get_vocab_base_pre = get_vocab_base_pre
base.TextModel._set_vocab_sentencepiece = _set_vocab_sentencepiece
sys.argv = [src + '/convert_hf_to_gguf.py'] + sys.argv[2:]
runpy.run_path(sys.argv[0], run_name='__main__')
"""


def convert_hf_to_gguf(hf_dir: str, out: str, outtype: str = "bf16", cache: str = CACHE) -> str:
    """HF directory -> GGUF with the tree's convert_hf_to_gguf.py (and its gguf-py); cached at `out`."""
    if os.path.isfile(out) and os.path.getsize(out) > 0:
        return out
    src = source_dir(cache)
    os.makedirs(os.path.dirname(os.path.abspath(out)) or ".", exist_ok=True)
    tmp, hf_dir = os.path.abspath(out + ".part"), os.path.abspath(hf_dir)
    # cwd: `python -c` puts the working directory first on sys.path, and batchrun's checkout has a top-level
    # kernels/ that would shadow HF's `kernels` package, which transformers imports
    _run([sys.executable, "-c", _CONVERT_BOOTSTRAP, src, hf_dir, "--outfile", tmp, "--outtype", outtype],
         log=os.path.join(cache, "convert.log"), timeout=1800, cwd=src)
    os.replace(tmp, out)
    return out


# -- llama-batched-bench ------------------------------------------------------------------------

BB_COLUMNS = ("pp", "tg", "pl", "n_kv", "t_pp", "speed_pp", "t_tg", "speed_tg", "t", "speed")
_BB_HEADER = ("PP", "TG", "B", "N_KV", "T_PP s", "S_PP t/s", "T_TG s", "S_TG t/s", "T s", "S t/s")


def parse_batched_bench(text: str) -> list[dict]:
    """Rows of llama-batched-bench's output, markdown table or jsonl (--output-format jsonl).

    Each row: pp, tg, pl, n_kv (int), t_pp, speed_pp, t_tg, speed_tg, t, speed (float). speed_tg (S_TG)
    is pl*tg / t_tg: decode tokens per second over tg steps of pl sequences, prompt time excluded."""
    rows: list[dict] = []
    header_seen = False
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("{") and '"speed_tg"' in s:
            try:
                d = json.loads(s)
            except ValueError:
                continue
            rows.append({k: (int(d[k]) if k in ("pp", "tg", "pl", "n_kv") else float(d[k])) for k in BB_COLUMNS})
            continue
        if not s.startswith("|"):
            continue
        cells = [c.strip() for c in s.strip("|").split("|")]
        if tuple(cells) == _BB_HEADER:
            header_seen = True
            continue
        if not header_seen or len(cells) != len(BB_COLUMNS) or set(cells[0]) <= {"-", ":"}:
            continue
        try:
            vals = [int(c) for c in cells[:4]] + [float(c) for c in cells[4:]]
        except ValueError:
            continue
        rows.append(dict(zip(BB_COLUMNS, vals)))
    return rows


def parse_bb_settings(text: str) -> dict:
    """The `n_kv_max = ..., flash_attn = ...` line batched-bench prints before its table."""
    m = re.search(r"n_kv_max = .*", text)
    if not m:
        return {}
    return {k: int(v) for k, v in re.findall(r"(\w+) = (-?\d+)", m.group(0))}


def batched_bench_argv(model: str, npp: int, ntg: int, npl: list[int], threads: int = 2,
                       ctx: Optional[int] = None, extra: tuple = (), cache: str = CACHE) -> list[str]:
    """The llama-batched-bench command line (building it first if needed); -c defaults to what the
    largest batch needs, pl*(npp+ntg) tokens. The caller runs it (bench_peers measures its peak RSS)."""
    exe = ensure_built(("llama-batched-bench",), cache)["llama-batched-bench"]
    ctx = ctx or max(npl) * (npp + ntg)
    return [exe, "-m", model, "-c", str(ctx), "-npp", str(npp), "-ntg", str(ntg),
            "-npl", ",".join(map(str, npl)), "-t", str(threads), "-tb", str(threads), *extra]


def main(argv: Optional[list[str]] = None) -> int:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--targets", default=",".join(TARGETS))
    b.add_argument("-j", type=int, default=2)
    c = sub.add_parser("convert")
    c.add_argument("hf_dir")
    c.add_argument("out")
    c.add_argument("--outtype", default="bf16")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "build":
            for t, p in ensure_built(tuple(a.targets.split(",")), jobs=a.j).items():
                print(t, p)
        else:
            print(convert_hf_to_gguf(a.hf_dir, a.out, a.outtype))
    except LlamaCppError as e:
        print(f"llama.cpp: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
