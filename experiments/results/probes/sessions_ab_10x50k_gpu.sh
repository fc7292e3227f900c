#!/usr/bin/env bash
# Stop 77: the issue's 10 x 50K A/B (offload vs resident, local99, MTP 0 and MTP 3 forced, interleaved pairs) on the
# build as it is, named by the card it ran on. The H200's figures (57a4fc8) predate the one-launch experts (f2a1453).
# Stop 79 ran it twice on one warm H100 at 5343805: MTP=3 BUDGET=380 PAIRS=2 MAX_PAIRS=6, then MTP=0 BUDGET=420
# PAIRS=3 MAX_PAIRS=8 (LIMIT=590; 217 s and 124 s).
LIMIT=${LIMIT:-580}
MTP=${MTP:-0,3}; PAIRS=${PAIRS:-3}; MAX_PAIRS=${MAX_PAIRS:-8}; BUDGET=${BUDGET:-400}
source experiments/results/probes/gpu_setup.sh
export JAX_PLATFORMS=cuda,cpu
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o 'H[0-9]\+' | head -1 | tr H h)
NAME=sessions_ab_10x50k_mtp${MTP//,/_mtp}_${GPU:-gpu}_$R
timeout $(( LIMIT - 40 )) python -m experiments.sessions_ab --config=configs/h200_bench.py --config.run.prompt_len=50000 \
  --config.run.max_new_tokens=512 --sessions=10 --pairs=$PAIRS --max_pairs=$MAX_PAIRS --mtp=$MTP --append=0 \
  --workload=local99 --budget_s=$BUDGET --out=$OUT/$NAME.json > $OUT/$NAME.log 2>&1
grep "loss\|identical\|Error\|error" $OUT/$NAME.log | cut -c1-300 | tail -30
python - $OUT/$NAME.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for n, s in d["settings"].items():
    print(n, "summary", {k: v for k, v in s["summary"].items() if not isinstance(v, (dict, list))})
    for p in s["pairs"]:
        r, o = p["resident"], p["offload"]
        print(n, "resident", round(r["aggregate_tokens_per_s"], 1), "offload", round(o["aggregate_tokens_per_s"], 1),
              "loss %", round(p["offload_loss_pct"], 3), "p99/median", round(o["step_call_p99_over_median"], 3),
              "tokens identical", p["tokens_identical"])
PY
el done
