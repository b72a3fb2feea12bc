#!/usr/bin/env bash
# One-command GPU check (under 5 minutes on one GPU). Writes figures as JSON to $OUT when set, else stdout.
#   1. kernel tests on CUDA   2. batchrun vs HF greedy equality on CUDA
#   3. throughput of a ~1B Llama-shape model   4. decode attention kernel vs copy bandwidth
#   5. weight-only int8/int4 Triton kernels: their tests, an engine's greedy tokens against the dequantised
#      reference (BATCHRUN_QUANT_KERNELS=0), and their time against bf16 F.linear on SmolLM2-135M's shapes
# --tiny (or GPU_CHECK_TINY=1) runs the same steps at toy size, on the CPU too (CI keeps the script honest).
set -uo pipefail
usage() {
    cat <<'USAGE'
usage: scripts/gpu_check.sh [--tiny] [--help]

Runs on one CUDA GPU (under 5 minutes): the kernel tests on CUDA, batchrun vs HF greedy equality,
a ~1B-model throughput run (scripts/gpu_bench.py), the decode-attention bandwidth check, and the
weight-only int8/int4 kernels (tests/test_quant_triton.py: kernels vs references, engine greedy tokens vs
BATCHRUN_QUANT_KERNELS=0; their time against bf16 F.linear at 1, 16 and 64 rows).
Prints one JSON object; with $OUT set it also writes $OUT/gpu_check.json and the logs.

  --tiny    toy sizes: a seconds-long dry run of the same steps, allowed without CUDA
  --help    this text

Environment: PYTHON (interpreter, default python), OUT (where to write), GPU_CHECK_TINY=1 (= --tiny).
Without CUDA (and without --tiny) it refuses at once with exit 2.
USAGE
}
tiny=${GPU_CHECK_TINY:-0}
for arg in "$@"; do
    case "$arg" in
        -h|--help) usage; exit 0 ;;
        --tiny) tiny=1 ;;
        *) echo "gpu_check.sh: unknown argument '$arg' (see --help)" >&2; exit 2 ;;
    esac
done
cd "$(dirname "$0")/.."
py=${PYTHON:-python}
dest=${OUT:-}
if [ "$tiny" != 1 ] && ! "$py" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_check.sh: CUDA is not available here (torch.cuda.is_available() is False); run it on a GPU machine, or pass --tiny for the CPU dry run" >&2
    exit 2
fi
work=$(mktemp -d)
status=0

run_pytest() {  # name, args...
    local name=$1; shift
    if "$py" -m pytest -q -p no:cacheprovider "$@" >"$work/$name.log" 2>&1; then
        echo "\"$name\": {\"ok\": true, \"summary\": \"$(tail -n 1 "$work/$name.log" | tr -d '"')\"}"
    else
        status=1
        echo "\"$name\": {\"ok\": false, \"summary\": \"$(tail -n 1 "$work/$name.log" | tr -d '"')\"}"
    fi
}

if [ "$tiny" = 1 ]; then
    kernels=$(run_pytest kernel_tests tests/test_kernels.py -k "store")
    hf=$(run_pytest hf_equality tests/test_engine_hf.py -k "logits and llama")
    bench_args=(--tiny)
    quant=$(run_pytest quant_tests tests/test_quant_triton.py -k "layout or bad_arguments")
else
    kernels=$(run_pytest kernel_tests tests/test_kernels.py)
    hf=$(run_pytest hf_equality tests/test_engine_hf.py -k "default or logits")
    bench_args=()
    quant=$(run_pytest quant_tests tests/test_quant_triton.py)
fi
if "$py" scripts/gpu_bench.py "${bench_args[@]}" --out "$work/bench.json" >"$work/bench.log" 2>&1; then
    bench=$(cat "$work/bench.json")
else
    status=1
    bench="{\"ok\": false, \"error\": \"$(tail -n 1 "$work/bench.log" | tr -d '"')\"}"
fi
# weight-only kernels against bf16 F.linear, per decode step's layer of SmolLM2-135M (time ratio < 1: faster);
# the --tiny dry run takes toy shapes, on the CPU under Triton's interpreter
if GPU_CHECK_TINY=$tiny "$py" - "$work/quant_speed.json" >"$work/quant_speed.log" 2>&1 <<'PY'
import json, os, sys, time
import torch
tiny, cuda = os.environ["GPU_CHECK_TINY"] == "1", torch.cuda.is_available()
if not cuda:
    os.environ["TRITON_INTERPRET"] = "1"        # before batchrun.kernels is imported
from batchrun.kernels import quant_matmul as qmm
from batchrun.models.quant import Int4Weight, quantize_int4, quantize_int8
dev, dt = torch.device("cuda" if cuda else "cpu"), torch.bfloat16
shapes = [(64, 64)] if tiny else [(960, 576), (576, 576), (3072, 576), (576, 1536)]   # qkv, o, gate_up, down
rows, group, reps = ((1, 4), 32, 1) if tiny else ((1, 16, 64), 64, 200)
torch.manual_seed(0)

def timed(fn):
    fn()
    if cuda: torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps): fn()
    if cuda: torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps

def int4(w):
    q = quantize_int4(w, group, dt)
    if q.layout != "nibbles":                  # the CPU dry run: the CUDA layout, built on CPU tensors
        sz = q.scales_and_zeros[:, :w.shape[0]]
        q = Int4Weight(q.codes(), sz[..., 0].T, sz[..., 1].T, group, dt, layout="nibbles")
    return q

out = {"ok": True, "device": torch.cuda.get_device_name() if cuda else "cpu (interpreter)",
       "shapes": shapes, "int4_group": group, "rows": {}}
err = 0.0
for m in rows:
    ms = {"bf16": 0.0, "int8": 0.0, "int4": 0.0}
    for n, k in shapes:
        w = torch.randn(n, k, device=dev) * 0.05
        x = torch.randn(m, k, device=dev).to(dt)
        wb, q8, q4 = w.to(dt), quantize_int8(w, dt), int4(w)
        fns = {"bf16": lambda: torch.nn.functional.linear(x, wb),
               "int8": lambda: qmm.int8_matmul(x, q8.q, q8.scales),
               "int4": lambda: qmm.int4_matmul(x, q4.packed, q4.scales_and_zeros, group, n)}
        for name, fn in fns.items():
            ms[name] += timed(fn) * 1e3
        for y, ref in ((fns["int8"](), qmm.int8_matmul_reference(x, q8.q, q8.scales)),
                       (fns["int4"](), qmm.int4_matmul_reference(x, q4.packed, q4.scales_and_zeros, group, n))):
            err = max(err, ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item())
    r = {f"{k}_ms": round(v, 4) for k, v in ms.items()}
    r.update(int8_vs_bf16=round(ms["int8"] / ms["bf16"], 3), int4_vs_bf16=round(ms["int4"] / ms["bf16"], 3))
    out["rows"][str(m)] = r
    print(f"rows {m}: " + ", ".join(f"{k} {v}" for k, v in r.items()))
out["max_rel_err_vs_reference"] = err
out["ok"] = err < 2 ** -5                      # bf16's tolerance in tests/test_quant_triton.py
json.dump(out, open(sys.argv[1], "w"))
PY
then
    quant_speed=$(cat "$work/quant_speed.json")
else
    status=1
    quant_speed="{\"ok\": false, \"error\": \"$(tail -n 1 "$work/quant_speed.log" | tr -d '"')\"}"
fi
tp=""
if [ "$tiny" != 1 ] && "$py" -c "import sys, torch; sys.exit(0 if torch.cuda.device_count() >= 2 else 1)"; then
    # tensor_parallel_size=2 over two GPUs (NCCL): token-identical to one
    tp=", $(BATCHRUN_TEST_TP_DEVICE=cuda run_pytest tp2 tests/test_tp_engine.py -k two_ranks)"
fi
json="{$kernels, $hf$tp, $quant, \"quant_speed\": $quant_speed, \"throughput\": $bench}"
case "$json" in *'"ok": false'*) status=1 ;; esac     # a step run in $(...) cannot set status itself
if [ -n "$dest" ]; then
    mkdir -p "$dest"
    echo "$json" >"$dest/gpu_check.json"
    cp "$work"/*.log "$dest/" 2>/dev/null
fi
echo "$json"
exit $status
