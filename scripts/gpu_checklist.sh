#!/usr/bin/env bash
# ../shared/GPU_CHECKLIST.md in calls that fit a lent GPU's limits.
#
#   bash scripts/gpu_checklist.sh PART OUTDIR      (on the GPU machine; OUTDIR defaults to $OUT)
#   ROCKETKV_COMMIT=<the commit, typed in> bash scripts/gpu_checklist.sh PART   (what to run:
#   the GPU machine's copy of the tree may carry a stale .git, as on 2026-11-27, where `git
#   rev-parse HEAD` named an older commit; the result files record ROCKETKV_COMMIT instead)
#
# The budget: a session has 15 minutes of device time in all, the machine's start (1-2 minutes)
# included, at most 10 minutes a command, and 8 files back from $OUT. So a GPU visit is ONE
# call, `first` (its step limits add up to at most 8 minutes), leaving time for one short rerun;
# every other part is one call of a later visit (its step limits add up to under 10 minutes),
# once `first` has run on the commit. tests/test_gpu_checklist.py adds up the `timeout` limits
# of each part from this text (a `timeout ... &` step runs beside the others up to the next
# `wait`: that group costs its longest limit) and fails when `first` reaches 500 s or another
# part 600 s, so every Python or device command here runs under its own `timeout`.
# Rows use --compile-regime graphs where they can (each row's eager step, our Triton kernels,
# captured in a CUDA graph in about a second instead of compiled in 47-88 s); check_targets
# judges each regime on its own rows, and k2 and p measure the static-compile regime after.
#
# first: the first call of every GPU visit: nvidia-smi, the versions and the C compiler
#    (Triton builds its launchers with one); the kernels' self-check (python -m rocketkv.engine.kernel_check;
#    the call goes on, saying so, when it is absent or fails) beside the CUDA tests
#    (pytest -m cuda), one process a test file, all at once, so a sticky CUDA error stays in
#    the file that raised it; kernels per step and layer at 32K of full and rocketkv@256
#    (profile_step.py, graphs regime); then the chart: full and rocketkv@256 at 16K-131008
#    (bench.py, graphs regime; rows saved as each finishes), and transformers' static cache at
#    32K in a call of its own (its 131008 row and batch 16 are part t's). Files back:
#    log-first.txt, profile-32768.{json,md}, <device>/bench-*.json
# k: the dense kernels' knobs at batch 1 over the quick grid, as a table
#    (tuned-dense-b1.json) the rest of the call uses and the session commits under
#    rocketkv/kernels/tuned/ for t and q; kernels per step and layer at 32K of full and rocketkv@256
#    with every kernel, and of rocketkv on the PyTorch path (--kernels off: the count before);
#    then full and the selecting methods @256 at 32K (first runs the CUDA tests)
# t: the targets' rows (items 2, 4 and 6): full and rocketkv@256 beside transformers' static
#    cache at 32K and 128K in one bench call (check_targets pairs peer rows with ours of the
#    same run), then 16K and 64K, then batch 16 at 32K
# q: int8 and int4 (group 128) weights (item 5): their CUDA tests, then full and rocketkv@256
#    at 32K and 128K
# k2: the selecting methods and full at 32K compiled (static regime), then full and
#    rocketkv@256 at 32K and 128K with --kernels sparse: our projection kernels against cuBLAS
# ks: one layer's selection and attention (scripts/bench_step.py, CUDA graphs of the eager
#    step) of rocketkv, hybrid, sparq and exact_topk @256 at 32K and 128K with the fused
#    selection split at 128-2048 pages a program (--knob SPLIT_PAGES; 2048, the default,
#    keeps RocketKV's 740 and 1171 pages in one program per KV head: 8 programs on the
#    H200's 132 SMs, 57 us a layer at 32K, results/NVIDIA-H200/README.md);
#    then Full-KV's attention over a grid of its launch constants (PREFIX_PROGRAMS,
#    ATTEND_TOKENS, PREFIX_WARPS: unmeasured); the fastest of each comes back as a table
#    (tuned-*.json) to commit under rocketkv/kernels/tuned/
# kd: the dense kernels alone against cuBLAS at the llama-3.1-8b projections over a grid of
#    launch configurations (scripts/bench_dense.py): batch 1 over the full grid, batch 16 over
#    the quick one; each launch's fastest knobs come back as tables (tuned-*.json) to commit
#    under rocketkv/kernels/tuned/ (the kernels read them on that GPU from then on)
# kq: the dense kernels on int8 and int4 (group 128) weights against the model's quantized layers
#    without them (int8 converted in the matmul, tinygemm), batch 1 and 16, quick grid, and
#    their fastest knobs as a table for rocketkv/kernels/tuned/
# p: part t's peers and part q's weights compiled (static regime): transformers' static cache
#    beside our full and rocketkv@256 at 32K and 128K in one bench call, then int8 and int4
#    weights with full and rocketkv@256 at 32K and 128K
# g1, g2: the paper's grid (full, gptfast_dense, rocketkv @256-4096; 16K-64K, then 96K and
#    128K) with --compile-regime graphs, so the grid fits two calls; the static-regime rows
#    of parts b and c say what compiling adds; scripts/plot_bench.py --regime graphs draws
#    the charts from both runs afterwards
# a: nvidia-smi and the versions, the smoke runs of generate.py at 32K (full, rocketkv@256),
#    the kernel profile of full and rocketkv@256 at 128K (first runs the CUDA tests)
# b: the targets' rows: full, rocketkv@256 and gptfast_dense at 96K and 128K (item 2)
# c: the rest of the sweep that fits one call, 16K-64K (item 2); every row compiles its own
#    static graph (47-88 s on the H200; the dynamic regime took 407 s for its first row)
# d: batch 16 at 32K (item 3), then every method at 32K (item 4), 1 of 3: a row compiles for
#    31-94 s on the H200, so the 14 rows take three calls
# e, f: every method at 32K, 2 and 3 of 3
# Every step has its own time limit, so a slow step leaves the next ones their time; bench.py
# and profile_step.py save their rows after every configuration (a CUDA error ends their run
# with the rows saved and one line naming the row); pytest is stopped with SIGINT, so a test run
# cut off still prints which tests passed and failed. Plots are drawn afterwards from the JSON
# (the device returns at most 8 files). The GPU machine runs a bare copy of the tree (no
# `pip install -e .`): PYTHONPATH puts the repository root on the path for scripts/ and evals/.
# tests/test_gpu_checklist.py runs every part here with a Python that records its arguments,
# and parses them with each script's own parser: a mistyped flag or method fails on CPU, not
# in a GPU call.
set -o pipefail
part=${1:?part first, k, t, q, k2, ks, kd, kq, p, g1, g2, a, b, c, d, e or f}
out=${2:-${OUT:?no OUTDIR and no \$OUT}}
py=${PYTHON:-python3}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
M="--config llama-3.1-8b --no-plots --out $out"
G="$M --compile-regime graphs"
export TRITON_INTERPRET=0  # the kernels compiled for the GPU, never the interpreter
step() { echo "=== $(date +%T) $*"; }
environment() {  # the first lines of a session's log: the GPU, the versions, the C compiler
    step env
    timeout 10 nvidia-smi
    timeout 30 $py -c "import torch, triton; p = torch.cuda.get_device_properties(0); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, p.name, p.multi_processor_count, 'SMs', p.total_memory >> 20, 'MiB', 'sm_%d%d' % (p.major, p.minor))"
    timeout 5 bash -c 'c=$(command -v cc || command -v gcc || command -v clang) && echo "C compiler: $c" && "$c" --version | head -1 || echo "no C compiler: Triton cannot build its launchers"'
}
{
case $part in
first)
    environment
    step "the kernels' self-check beside the CUDA tests, one process a test file"
    (timeout 120 $py -m rocketkv.engine.kernel_check --device cuda; echo "exit $? (kernel_check: 0 passed; 1 absent or failed; 124 cut off)") > "$out/run-check.txt" 2>&1 &
    for f in $(grep -lE "pytest\.mark\.cuda\b" tests/test_*.py); do
        n=1; [ "$f" = tests/test_kernels.py ] && n=3  # 34 tests: 22 ran in 140 s on the H200
        for i in $(seq 0 $((n - 1))); do
            (timeout -s INT -k 10 140 $py -m pytest -q -p no:cacheprovider -m cuda --shard $i/$n "$f"; echo "exit $?") > "$out/run-$(basename "$f" .py)-$i.txt" 2>&1 &
        done
    done
    wait
    for f in "$out"/run-*.txt; do step "${f##*/run-}"; cat "$f"; rm -f "$f"; done
    step "kernels per step and layer at 32K: full and rocketkv@256, CUDA graphs of the eager step"
    timeout 40 $py scripts/profile_step.py --context 32768 --methods full rocketkv \
        --budgets 256 --compile-regime graphs --out "$out" | grep -v "^|"
    # the chart's rows, each call under its own limit so that a slow peer costs only its own
    # rows (2026-11-27: ours at 32K and 131008 took 48 s in all, transformers at 32K 37 s and
    # at 131008 more than the 105 s it had left)
    step "full and rocketkv@256 at 16K, 32K, 64K and 131008, graphs regime"
    timeout 165 $py scripts/bench.py $G --context 16384 32768 65536 131008 --methods full \
        rocketkv --budgets 256 --time-limit 130
    step "transformers' static cache at 32K"
    timeout 95 $py scripts/bench.py $G --context 32768 --methods transformers --time-limit 10
    ;;
k)
    environment
    step "the dense kernels' knobs at batch 1 (quick grid): a table this call's rows use"
    timeout 110 $py scripts/bench_dense.py --batch-sizes 1 --grid quick \
        --json "$out/bench_dense-k.json" --tuned "$out/tuned-dense-b1.json" | tail -6
    [ -s "$out/tuned-dense-b1.json" ] && cp "$out/tuned-dense-b1.json" \
        rocketkv/kernels/tuned/0-session-dense-b1.json  # the launches it measured, even if cut off
    step "kernels per step at 32K: every kernel (full, rocketkv), the PyTorch path"
    timeout 90 $py scripts/profile_step.py --context 32768 --methods full rocketkv \
        --budgets 256 --compile-regime graphs --out "$out" | grep -v "^|" | head -20
    timeout 70 $py scripts/profile_step.py --context 32768 --methods rocketkv --budgets 256 \
        --compile-regime graphs --kernels off --out "$out/pytorch" | grep -v "^|" | head -12
    step "full and the selecting methods @256 at 32K"
    timeout 120 $py scripts/bench.py $G --context 32768 --methods full rocketkv hybrid quest \
        sparq exact_topk --budgets 256 --time-limit 80
    rm -f rocketkv/kernels/tuned/0-session-*.json  # this call's copy: the committed table serves later
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
    step "the selection's split at 32K and 128K: 128, 256, 512 and 2048 pages a program"
    timeout 330 $py scripts/bench_step.py --context 32768 131008 --methods rocketkv hybrid \
        sparq exact_topk --budgets 256 --knob SPLIT_PAGES=128,256,512,2048 --cuda-graphs \
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
    timeout -s INT -k 10 90 $py -m pytest -q -p no:cacheprovider tests/test_quantize.py \
        tests/test_dense_kernels.py -k "cuda_kernels or cuda_quantized"
    step peers: transformers beside full and rocketkv@256
    timeout 280 $py scripts/bench.py $M --context 32768 131008 --methods full rocketkv \
        transformers --budgets 256 --time-limit 220
    step quantized weights
    timeout 190 $py scripts/bench.py $M --context 32768 131008 --methods full rocketkv \
        --budgets 256 --weights int8 int4-g128 --time-limit 140
    ;;
g1|g2)
    if [ "$part" = g1 ]; then ctx="16384 32768 65536"; else ctx="98304 131008"; fi
    step "the paper's grid, CUDA graphs of the eager step, contexts $ctx"
    timeout 570 $py scripts/bench.py $M --context $ctx --methods full gptfast_dense rocketkv \
        --budgets 256 512 1024 2048 4096 --compile-regime graphs --time-limit 500
    ;;
a)
    environment
    step smoke full
    timeout 120 $py generate.py --checkpoint random:llama-3.1-8b --random-prompt 32768 \
        --max-new-tokens 64 --method full --json "$out/smoke-full.json" | tail -8
    step smoke rocketkv --budget 256
    timeout 120 $py generate.py --checkpoint random:llama-3.1-8b --random-prompt 32768 \
        --max-new-tokens 64 --method rocketkv --budget 256 --json "$out/smoke-rocketkv.json" \
        | tail -8
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
