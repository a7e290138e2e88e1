S=../shared/data/models/SmolLM2-135M-Instruct.Q4_1.gguf
Q=/root/.cache/rocketkv-data/Qwen2.5-Coder-0.5B-Instruct.gguf
run() { # ck ctx threads spin
  if [ "$4" = P ]; then unset GOMP_SPINCOUNT; else export GOMP_SPINCOUNT=$4; fi
  python generate.py --checkpoint $1 --random-prompt $2 --max-new-tokens 40 --ignore-eos --threads $3 --no-progress --json /tmp/th.json >/dev/null 2>&1
  echo "$5 $(basename $1) ctx=$2 threads=$3 spin=$4 step_ms=$(python -c "import json;d=json.load(open('/tmp/th.json'));print(round(d['decode_ms_median'],2))") load=$(cut -d' ' -f1 /proc/loadavg)"
}
for hog in 0 1; do
  if [ $hog = 1 ]; then python -c "while True: pass" & HOG=$!; sleep 3; fi
  for rep in 1 2; do for ck in $S $Q; do for cfg in "1 P" "2 P" "2 300000" "2 30000" "2 3000"; do set -- $cfg; run $ck 16 $1 $2 "hog=$hog rep=$rep"; done; done; done
  if [ $hog = 1 ]; then kill $HOG; fi
done
