#!/usr/bin/env bash
# ../shared/GPU_CHECKLIST.md in calls that fit a lent GPU's 10-minute command limit.
#
#   bash scripts/gpu_checklist.sh PART OUTDIR      (on the GPU machine; OUTDIR defaults to $OUT)
#
# a: nvidia-smi, versions, the CUDA-only tests, the smoke runs (item 1), the sweep's 96K and
#    128K rows for full / gptfast_dense / rocketkv@256 (item 2, the targets' contexts)
# b: the CUDA-only tests, the full-cache smoke run, one layer's step (flex decode against the
#    masked formula), the kernel profile at 128K (item 5)
# c: the sweep (item 2) in the dynamic compile regime (one compile per method structure)
# d: batch 16 at 32K (item 3), every method at 32K (item 4)
# Every step has its own time limit, so a slow step leaves the next ones their time; bench.py
# saves its rows after every configuration. Plots are drawn afterwards from the JSON (the
# device returns at most 8 files).
set -o pipefail
part=${1:?part a, b or c}
out=${2:-${OUT:?no OUTDIR and no \$OUT}}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
M="--model llama-3.1-8b --no-plots --out $out"
step() { echo "=== $(date +%T) $*"; }
{
case $part in
a)
    step env; nvidia-smi
    $py -c "import torch, triton; p = torch.cuda.get_device_properties(0); print('torch', torch.__version__, 'triton', triton.__version__, p.name, p.multi_processor_count, 'SMs', p.total_memory >> 20, 'MiB')"
    step cuda tests
    timeout 150 $py -m pytest -q -p no:cacheprovider tests/test_kv_cache.py tests/test_keydiff_omnikv.py -k cuda
    for m in "full" "rocketkv --budget 256"; do
        step smoke $m
        timeout 120 $py generate.py --checkpoint random:llama-3.1-8b --prompt-tokens 32768 \
            --max-new-tokens 64 --method $m --json "$out/smoke-${m%% *}.json" | tail -8
    done
    step sweep 96K 128K
    timeout 240 $py scripts/bench.py $M --context 98304 131008 --methods full gptfast_dense rocketkv \
        --budgets 256 --time-limit 200
    ;;
b)
    step cuda tests
    timeout 150 $py -m pytest -q -p no:cacheprovider tests/test_kv_cache.py tests/test_keydiff_omnikv.py -k cuda
    step smoke full
    timeout 150 $py generate.py --checkpoint random:llama-3.1-8b --prompt-tokens 32768 \
        --max-new-tokens 64 --method full --json "$out/smoke-full.json" | tail -8
    step one layer: flex decode, the masked formula, rocketkv
    timeout 120 $py scripts/bench_step.py --context 32768 131008 --methods full rocketkv \
        --budgets 256 --out "$out/bench_step-flex.json" | tail -12
    timeout 90 $py -c "import runpy, sys, kv_cache; kv_cache.FLEX_DECODE = False
sys.argv = ['scripts/bench_step.py', '--context', '32768', '131008', '--methods', 'full', '--out', '$out/bench_step-formula.json']
runpy.run_path('scripts/bench_step.py', run_name='__main__')" | tail -6
    step profile 128K
    timeout 230 $py scripts/profile_step.py --context 131008 --methods full rocketkv --budgets 256 \
        --out "$out" | grep -v "^|" | head -20
    ;;
c)
    step sweep 16K-128K, one compile per method structure
    timeout 560 $py scripts/bench.py $M --compile-regime dynamic --methods full gptfast_dense \
        rocketkv --budgets 256 1024 4096 --time-limit 470
    ;;
d)
    step batch 16
    timeout 200 $py scripts/bench.py $M --batch-sizes 16 --context 32768 --methods full rocketkv \
        --budgets 256 --time-limit 150
    step every method at 32K
    timeout 330 $py scripts/bench.py $M --context 32768 --methods all --budgets 256 \
        --compile-regime dynamic --time-limit 250
    ;;
*)
    echo "unknown part $part"; exit 2 ;;
esac
step done
} 2>&1 | tee -a "$out/log-$part.txt"
