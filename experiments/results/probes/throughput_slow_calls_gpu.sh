#!/usr/bin/env bash
# Stop 75: which step calls make offload's one-session throughput point slower than resident's? The 8K curve at
# de680c4 (H100) had equal median step intervals in both modes, but a few offload step calls of 38-84 ms at one
# session and 9-11 ms at four. This runs the 8K points of 1 and 4 sessions twice, with 4 and with 72 untimed warm-up
# tokens (the second moves the timed steps past the first page copies), and prints each point's slowest step calls
# beside the steps that copied a page to host memory and those that ran the copyback (72a54a9's host fields).
# Ran at 86e22e0 on an H100, typed into the call after draw_peak_gpu.py and the API tests, with --routing=uniform
# and 170 s a run (the 72-token run's four-session offload point did not fit): throughput_8k_slow_calls_w{4,72}_
# h100_86e22e0.json. RUN_S sets a run's seconds.
LIMIT=${LIMIT:-560}
NEW=${NEW:-192}
source experiments/results/probes/gpu_setup.sh
export JAX_PLATFORMS=cuda,cpu
for W in 4 72; do
  NAME=throughput_8k_slow_calls_w${W}_$R
  timeout ${RUN_S:-$(( (LIMIT - 40) / 2 ))} python -m experiments.throughput --config=configs/h200_bench.py \
    --histories=8192 --sessions=1,4 --new_tokens=$NEW --warmup_tokens=$W --routing=uniform --out=$OUT/$NAME.json \
    > $OUT/$NAME.log 2>&1
  grep "tok/s\|identical\|Error" $OUT/$NAME.log | cut -c1-300
  python - $OUT/$NAME.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for p in d["points"]:
    h = p["host"]
    print(p["mode"], p["sessions"], "tok/s", round(p["tokens_per_s"], 1), "slowest", h["slowest_step_calls_ms"],
          "copy_steps", h["copy_steps"], "copyback_steps", h["copyback_steps"],
          "call/wait/interval p50 ms", *(round(h[k]["p50"], 2) for k in ("step_call_ms", "step_wait_ms", "step_interval_ms")))
PY
  el "warmup $W done"
done
