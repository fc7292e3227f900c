#!/usr/bin/env bash
# Stop 76: the 8K points of 1 and 4 sessions again after experiments.throughput's warm-up became runs of the timed
# length repeated while one compiled anything (cmdbuf_one_session_*_h100_3743e1f.json: the single warm-up's rollback
# loaded offload's truncate_slot, XLA dropped every CUDA graph, and the timed run's first ring calls recorded again).
source experiments/results/probes/gpu_setup.sh
export JAX_PLATFORMS=cuda,cpu
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o 'H[0-9]\+' | head -1 | tr H h)
NAME=throughput_8k_warm_${GPU:-gpu}_$R
timeout ${RUN_S:-$(( LIMIT - 30 ))} python -m experiments.throughput --config=configs/h200_bench.py \
  --histories=8192 --sessions=1,4 --new_tokens=${NEW:-192} --routing=uniform --out=$OUT/$NAME.json > $OUT/$NAME.log 2>&1
grep "tok/s\|identical\|Error" $OUT/$NAME.log | cut -c1-300
python - $OUT/$NAME.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for p in d["points"]:
    h = p["host"]
    print(p["mode"], p["sessions"], "tok/s", round(p["tokens_per_s"], 1), "warm-up runs", p["warmup_runs"],
          [round(x, 1) for x in p["warmup_compile_s"]], "slowest", h["slowest_step_calls_ms"],
          "call/wait/interval p50 ms", *(round(h[k]["p50"], 2) for k in ("step_call_ms", "step_wait_ms", "step_interval_ms")))
PY
el done
