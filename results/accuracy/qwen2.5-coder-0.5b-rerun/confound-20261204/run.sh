#!/bin/bash
# RULER 4K and needle 8K, 10 prompts each, on a commit later than the 32K pieces (0ed2369)
cd <clone at 0ed2369>
Q=~/.cache/rocketkv-data/Qwen2.5-Coder-0.5B-Instruct.gguf
export PYTHONPATH=.  # the clone
date -u > out/ruler_4k.time
/usr/bin/time -v python scripts/eval_ruler.py --checkpoint $Q --context 4096 --samples 5 --budgets 256 \
  --methods full exact_topk rocketkv snapkv_pp hybrid quest sparq omnikv duoattention streamingllm h2o keydiff \
  --modes standard --workers 1 --threads 1 --batch-size 5 --limit 10 --time-limit 9000 --out out/ruler_4k --no-progress > out/ruler_4k.log 2>&1
date -u >> out/ruler_4k.time
/usr/bin/time -v python scripts/eval_needle.py --checkpoint $Q --context 8192 --depths 10 --needles 2 --budgets 256 \
  --methods full exact_topk rocketkv snapkv_pp snapkv hybrid quest sparq omnikv duoattention streamingllm h2o keydiff \
  --modes standard --workers 1 --threads 1 --batch-size 4 --limit 10 --time-limit 9000 --out out/needle_8k --no-progress > out/needle_8k.log 2>&1
date -u >> out/ruler_4k.time
