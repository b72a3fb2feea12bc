#!/usr/bin/env bash
# One-command GPU check (under 5 minutes on one GPU). Writes figures as JSON to $OUT when set, else stdout.
#   1. kernel tests on CUDA   2. batchrun vs HF greedy equality on CUDA
#   3. throughput of a ~1B Llama-shape model   4. decode attention kernel vs copy bandwidth
# GPU_CHECK_TINY=1 runs the same steps at toy size (CI runs it on CPU to keep the script honest).
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python}
tiny=${GPU_CHECK_TINY:-0}
dest=${OUT:-}
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
    kernels=$(run_pytest kernel_tests tests/test_kernels.py -k "store or rms")
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
json="{$kernels, $hf, \"throughput\": $bench}"
if [ -n "$dest" ]; then
    mkdir -p "$dest"
    echo "$json" >"$dest/gpu_check.json"
    cp "$work"/*.log "$dest/" 2>/dev/null
fi
echo "$json"
exit $status
