#!/usr/bin/env bash
# ../shared/GPU_CHECKLIST.md in calls that fit a lent GPU's 10-minute command limit.
#
#   bash scripts/gpu_checklist.sh PART OUTDIR      (on the GPU machine; OUTDIR defaults to $OUT)
#
# A session's 30 minutes of device time hold three calls: k, t and q come first, in that order
# (commit k's tuned-dense-b1.json under kernels/tuned/ before t: the device runs a copy of the
# working tree, so t and q then launch with its knobs).
# Their rows use --compile-regime graphs (each row's eager step, our Triton kernels, captured in
# a CUDA graph in about a second instead of compiled in 47-88 s), so one call holds the rows the
# issues' targets need; check_targets judges each regime on its own rows, and k2 and p measure
# the static-compile regime of the same rows afterwards.
#
# k: the fused Triton kernels of the decode step (kernels/sparse.py, kernels/dense.py): their
#    CUDA tests at real shapes and the CUDA graph of the eager step with them (item 1); the
#    dense kernels' knobs at batch 1 over the quick grid, as a table (tuned-dense-b1.json)
#    the rest of the call uses and the session commits under kernels/tuned/ for t and q;
#    kernels per step and layer at 32K of full and rocketkv@256 with every kernel, and of
#    rocketkv on the PyTorch path (--kernels off: the count before); then full and the
#    selecting methods @256 at 32K (item 2)
# t: the targets' rows (items 2, 4 and 6): full and rocketkv@256 beside transformers' static
#    cache at 32K and 128K in one bench call (check_targets pairs peer rows with ours of the
#    same run), then 16K and 64K, then batch 16 at 32K
# q: int8 and int4 (group 128) weights (item 5): their CUDA tests, then full and rocketkv@256
#    at 32K and 128K
# k2: the selecting methods and full at 32K compiled (static regime), then full and
#    rocketkv@256 at 32K and 128K with --kernels sparse: our projection kernels against cuBLAS
# ks: one layer's selection and attention (scripts/bench_step.py, CUDA graphs of the eager
#    step) of rocketkv, hybrid, sparq and exact_topk @256 at 32K and 128K with the fused
#    selection split at 1024-8192 pages a program (--knob SPLIT_PAGES; 2048, unmeasured);
#    then Full-KV's attention over a grid of its launch constants (PREFIX_PROGRAMS,
#    ATTEND_TOKENS, PREFIX_WARPS: unmeasured); the fastest of each comes back as a table
#    (tuned-*.json) to commit under kernels/tuned/
# kd: the dense kernels alone against cuBLAS at the llama-3.1-8b projections over a grid of
#    launch configurations (scripts/bench_dense.py): batch 1 over the full grid, batch 16 over
#    the quick one; each launch's fastest knobs come back as tables (tuned-*.json) to commit
#    under kernels/tuned/ (the kernels read them on that GPU from then on)
# kq: the dense kernels on int8 and int4 (group 128) weights against the model's quantized layers
#    without them (int8 converted in the matmul, tinygemm), batch 1 and 16, quick grid, and
#    their fastest knobs as a table for kernels/tuned/
# p: part t's peers and part q's weights compiled (static regime): transformers' static cache
#    beside our full and rocketkv@256 at 32K and 128K in one bench call, then int8 and int4
#    weights with full and rocketkv@256 at 32K and 128K
# g1, g2: the paper's grid (full, gptfast_dense, rocketkv @256-4096; 16K-64K, then 96K and
#    128K) with --compile-regime graphs, so the grid fits two calls; the static-regime rows
#    of parts b and c say what compiling adds; scripts/plot_bench.py --regime graphs draws
#    the charts from both runs afterwards
# a: nvidia-smi, versions, the CUDA-only tests, the smoke runs (item 1), the kernel profile of
#    full and rocketkv@256 at 128K (item 5)
# b: the targets' rows: full, rocketkv@256 and gptfast_dense at 96K and 128K (item 2)
# c: the rest of the sweep that fits one call, 16K-64K (item 2); every row compiles its own
#    static graph (47-88 s on the H200; the dynamic regime took 407 s for its first row)
# d: batch 16 at 32K (item 3), then every method at 32K (item 4), 1 of 3: a row compiles for
#    31-94 s on the H200, so the 14 rows take three calls
# e, f: every method at 32K, 2 and 3 of 3
# Every step has its own time limit, so a slow step leaves the next ones their time; bench.py
# saves its rows after every configuration; pytest is stopped with SIGINT, so a test run cut
# off still prints which tests passed and failed. Plots are drawn afterwards from the JSON (the
# device returns at most 8 files). The GPU machine runs a bare copy of the tree (no
# `pip install -e .`): PYTHONPATH puts the repository root on the path for scripts/ and evals/.
# tests/test_gpu_checklist.py runs every part here with a Python that records its arguments,
# and parses them with each script's own parser: a mistyped flag or method fails on CPU, not
# in a GPU call.
set -o pipefail
part=${1:?part k, t, q, k2, ks, kd, kq, p, g1, g2, a, b, c, d, e or f}
out=${2:-${OUT:?no OUTDIR and no \$OUT}}
py=${PYTHON:-python3}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
M="--checkpoint llama-3.1-8b --no-plots --out $out"
G="$M --compile-regime graphs"
step() { echo "=== $(date +%T) $*"; }
environment() {  # the first lines of a session's log: the GPU and the versions
    step env; nvidia-smi
    $py -c "import torch, triton; p = torch.cuda.get_device_properties(0); print('torch', torch.__version__, 'triton', triton.__version__, p.name, p.multi_processor_count, 'SMs', p.total_memory >> 20, 'MiB')"
}
{
case $part in
k)
    environment
    step "kernel tests on CUDA, and the CUDA graph of the eager step (--compile-regime graphs)"
    timeout -s INT -k 20 230 $py -m pytest -q -p no:cacheprovider tests/test_kernels.py \
        tests/test_dense_kernels.py tests/test_generate.py -k "cuda and not cli and not before"
    step "the dense kernels' knobs at batch 1 (quick grid): a table this call's rows use"
    timeout 110 $py scripts/bench_dense.py --batch-sizes 1 --grid quick \
        --json "$out/bench_dense-k.json" --tuned "$out/tuned-dense-b1.json" | tail -6
    [ -s "$out/tuned-dense-b1.json" ] && cp "$out/tuned-dense-b1.json" \
        kernels/tuned/0-session-dense-b1.json  # the launches it measured, even if cut off
    step "kernels per step at 32K: every kernel (full, rocketkv), the PyTorch path"
    timeout 90 $py scripts/profile_step.py --context 32768 --methods full rocketkv \
        --budgets 256 --compile-regime graphs --out "$out" | grep -v "^|" | head -20
    timeout 70 $py scripts/profile_step.py --context 32768 --methods rocketkv --budgets 256 \
        --compile-regime graphs --kernels off --out "$out/pytorch" | grep -v "^|" | head -12
    step "full and the selecting methods @256 at 32K"
    timeout 120 $py scripts/bench.py $G --context 32768 --methods full rocketkv hybrid quest \
        sparq exact_topk --budgets 256 --time-limit 80
    rm -f kernels/tuned/0-session-*.json  # this call's copy: the committed table serves later
    ;;
t)
    step "full and rocketkv@256 beside transformers at 32K and 128K, one run"
    timeout 340 $py scripts/bench.py $G --context 32768 131008 --methods full rocketkv \
        transformers --budgets 256 --time-limit 250
    step "full and rocketkv@256 at 16K and 64K"
    timeout 100 $py scripts/bench.py $G --context 16384 65536 --methods full rocketkv \
        --budgets 256 --time-limit 60
    step "batch 16 at 32K"
    timeout 130 $py scripts/bench.py $G --batch-sizes 16 --context 32768 --methods full \
        rocketkv --budgets 256 --time-limit 60
    ;;
q)
    step int8 and int4 CUDA kernels against dequantized matmuls
    timeout -s INT -k 20 100 $py -m pytest -q -p no:cacheprovider tests/test_quantize.py \
        tests/test_dense_kernels.py -k "cuda_kernels or cuda_quantized"
    step "int8 and int4-g128 weights: full and rocketkv@256 at 32K and 128K"
    timeout 450 $py scripts/bench.py $G --context 32768 131008 --methods full rocketkv \
        --budgets 256 --weights int4-g128 int8 --time-limit 380
    ;;
k2)
    step selecting methods at 32K with every kernel, compiled
    timeout 300 $py scripts/bench.py $M --context 32768 --methods full rocketkv hybrid quest \
        sparq exact_topk --budgets 256 --time-limit 240
    step "full and rocketkv@256 with the sparse kernels only (cuBLAS projections)"
    timeout 250 $py scripts/bench.py $M --context 32768 131008 --methods full rocketkv \
        --budgets 256 --kernels sparse --time-limit 190
    ;;
ks)
    step "the selection's split at 32K and 128K: 1024, 2048, 4096 and 8192 pages a program"
    timeout 330 $py scripts/bench_step.py --context 32768 131008 --methods rocketkv hybrid \
        sparq exact_topk --budgets 256 --knob SPLIT_PAGES=1024,2048,4096,8192 --cuda-graphs \
        --steps 20 --json "$out/bench_step-split.json" --tuned "$out/tuned-split.json" \
        | tail -34
    step "Full-KV's attention at 32K and 128K: programs, slots an iteration, warps"
    timeout 220 $py scripts/bench_step.py --context 32768 131008 --methods full \
        --knob PREFIX_PROGRAMS=256,512,1024,2048 --knob ATTEND_TOKENS=32,64,128 \
        --knob PREFIX_WARPS=4,8 --cuda-graphs --steps 20 --json "$out/bench_step-prefix.json" \
        --tuned "$out/tuned-prefix.json" | tail -50
    ;;
kd)
    step "dense kernels against cuBLAS, batch 1, full grid"
    timeout 380 $py scripts/bench_dense.py --batch-sizes 1 --grid full \
        --json "$out/bench_dense-b1.json" --tuned "$out/tuned-float-b1.json"
    step "dense kernels against cuBLAS, batch 16, quick grid"
    timeout 170 $py scripts/bench_dense.py --batch-sizes 16 --grid quick \
        --json "$out/bench_dense-b16.json" --tuned "$out/tuned-float-b16.json"
    ;;
kq)
    step "dense kernels on int8 and int4-g128 weights against torch's quantized matmuls"
    timeout 560 $py scripts/bench_dense.py --batch-sizes 1 16 --grid quick \
        --weights int8 int4-g128 --json "$out/bench_dense-quantized.json" \
        --tuned "$out/tuned-quantized.json"
    ;;
p)
    step int8 and int4 CUDA kernels against dequantized matmuls
    timeout -s INT -k 20 100 $py -m pytest -q -p no:cacheprovider tests/test_quantize.py \
        tests/test_dense_kernels.py -k "cuda_kernels or cuda_quantized"
    step peers: transformers beside full and rocketkv@256
    timeout 290 $py scripts/bench.py $M --context 32768 131008 --methods full rocketkv \
        transformers --budgets 256 --time-limit 230
    step quantized weights
    timeout 200 $py scripts/bench.py $M --context 32768 131008 --methods full rocketkv \
        --budgets 256 --weights int8 int4-g128 --time-limit 150
    ;;
g1|g2)
    if [ "$part" = g1 ]; then ctx="16384 32768 65536"; else ctx="98304 131008"; fi
    step "the paper's grid, CUDA graphs of the eager step, contexts $ctx"
    timeout 570 $py scripts/bench.py $M --context $ctx --methods full gptfast_dense rocketkv \
        --budgets 256 512 1024 2048 4096 --compile-regime graphs --time-limit 500
    ;;
a)
    environment
    step cuda tests
    timeout -s INT -k 20 150 $py -m pytest -q -p no:cacheprovider tests/test_kv_cache.py tests/test_keydiff_omnikv.py tests/test_kernels.py tests/test_dense_kernels.py -k cuda
    for m in "full" "rocketkv --budget 256"; do
        step smoke $m
        timeout 150 $py generate.py --checkpoint random:llama-3.1-8b --prompt-tokens 32768 \
            --max-new-tokens 64 --method $m --json "$out/smoke-${m%% *}.json" | tail -8
    done
    step profile 128K
    timeout 230 $py scripts/profile_step.py --context 131008 --methods full rocketkv --budgets 256 \
        --out "$out" | grep -v "^|" | head -20
    ;;
b)
    step target rows: 96K and 128K
    timeout 560 $py scripts/bench.py $M --context 131008 98304 --methods full rocketkv \
        gptfast_dense --budgets 256 --time-limit 420
    ;;
c)
    step sweep, 16K-64K, static compile per row
    timeout 560 $py scripts/bench.py $M --context 16384 32768 65536 --methods full gptfast_dense \
        rocketkv --budgets 256 1024 4096 --time-limit 420
    ;;
d)
    step batch 16
    timeout 250 $py scripts/bench.py $M --batch-sizes 16 --context 32768 --methods full rocketkv \
        --budgets 256 --time-limit 150
    step every method at 32K, 1 of 3
    timeout 300 $py scripts/bench.py $M --context 32768 --methods full gptfast_dense exact_topk \
        snapkv --budgets 256 --time-limit 230
    ;;
e)
    step every method at 32K, 2 of 3
    timeout 560 $py scripts/bench.py $M --context 32768 --methods snapkv_pp quest sparq hybrid \
        rocketkv --budgets 256 --time-limit 440
    ;;
f)
    step every method at 32K, 3 of 3
    timeout 560 $py scripts/bench.py $M --context 32768 --methods streamingllm h2o duoattention \
        keydiff omnikv --budgets 256 --time-limit 440
    ;;
*)
    echo "unknown part $part"; exit 2 ;;
esac
step done
} 2>&1 | tee -a "$out/log-$part.txt"
