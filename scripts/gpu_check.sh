#!/usr/bin/env bash
# One-command GPU check (under 5 minutes on one GPU). Writes figures as JSON to $OUT when set, else stdout.
#   1. kernel tests on CUDA   2. batchrun vs HF greedy equality on CUDA
#   3. throughput of a ~1B Llama-shape model   4. decode attention kernel vs copy bandwidth
# --tiny (or GPU_CHECK_TINY=1) runs the same steps at toy size, on the CPU too (CI keeps the script honest).
set -uo pipefail
usage() {
    cat <<'USAGE'
usage: scripts/gpu_check.sh [--tiny] [--help]

Runs on one CUDA GPU (under 5 minutes): the kernel tests on CUDA, batchrun vs HF greedy equality,
a ~1B-model throughput run (scripts/gpu_bench.py) and the decode-attention bandwidth check.
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
else
    kernels=$(run_pytest kernel_tests tests/test_kernels.py)
    hf=$(run_pytest hf_equality tests/test_engine_hf.py -k "default or logits")
    bench_args=()
fi
if "$py" scripts/gpu_bench.py "${bench_args[@]}" --out "$work/bench.json" >"$work/bench.log" 2>&1; then
    bench=$(cat "$work/bench.json")
else
    status=1
    bench="{\"ok\": false, \"error\": \"$(tail -n 1 "$work/bench.log" | tr -d '"')\"}"
fi
tp=""
if [ "$tiny" != 1 ] && "$py" -c "import sys, torch; sys.exit(0 if torch.cuda.device_count() >= 2 else 1)"; then
    # tensor_parallel_size=2 over two GPUs (NCCL): token-identical to one
    tp=", $(BATCHRUN_TEST_TP_DEVICE=cuda run_pytest tp2 tests/test_tp_engine.py -k two_ranks)"
fi
json="{$kernels, $hf$tp, \"throughput\": $bench}"
if [ -n "$dest" ]; then
    mkdir -p "$dest"
    echo "$json" >"$dest/gpu_check.json"
    cp "$work"/*.log "$dest/" 2>/dev/null
fi
echo "$json"
exit $status
