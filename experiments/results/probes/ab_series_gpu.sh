#!/usr/bin/env bash
# H200 call of stop 44: the 10 x 50K A/B (offload vs resident, output rings, local99, MTP 0 and MTP 3 forced, one
# pair each), as cmdbuf_ab_gpu.sh ran it at 2374982, now with the working sets in one set of device buffers across
# runs (workloads.Selections) and an MTP run's plain first step freeing its outputs before the verify loop: do the
# runs' first step calls still record their CUDA graphs (their slowest calls at steps 1-3), and what is the
# step-call p99 / median? Run at 297bef8, then again after the ring's buffers were made before a loop's first
# call and sessions_ab warmed up until a round compiled nothing (ab_cmdbuf_gpu.sh found both).
# Stop 45 ran it with NEW=2048 (tokens a session per run: 2,048 step calls at MTP 0 and 512 at MTP 3, so a run's p99
# is not its one or two slowest calls, as with 128 verify calls at MTP 3 and 512 tokens) and PAIRS=2.
LIMIT=${LIMIT:-560}
MTP=${MTP:-0,3}; NEW=${NEW:-512}; PAIRS=${PAIRS:-1}; BUDGET=${BUDGET:-150}
source experiments/results/probes/gpu_setup.sh
NAME=sessions_ab_10x50k_mtp${MTP//,/_mtp}_series$([ "$NEW" = 512 ] || echo "_$NEW")_$R.json
export JAX_PLATFORMS=cuda,cpu
timeout $(( LIMIT - 60 )) python -m experiments.sessions_ab --config=configs/h200_bench.py --config.run.prompt_len=50000 \
  --config.run.max_new_tokens=$NEW --sessions=10 --pairs=$PAIRS --max_pairs=$PAIRS --mtp=$MTP --append=0 \
  --workload=local99 --budget_s=$BUDGET --out=$OUT/$NAME 2>&1 | grep "loss\|p99\|identical\|Error" | cut -c1-400
python - $OUT/$NAME <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for n, s in d["settings"].items():
    for p in s["pairs"]:
        for m in ("resident", "offload"):
            q = p[m]
            print(n, m, round(q["aggregate_tokens_per_s"], 1), "p99/median", round(q["step_call_p99_over_median"], 3),
                  "calls", len(q["step_calls_ms"]), "over 1.25x median", q["step_calls_over_1_25x_median"],
                  {k: round(v, 3) for k, v in q["step_call_ms"].items()}, q["slowest_step_calls_ms"][:8])
        print(n, "loss %", round(p["offload_loss_pct"], 3), "tokens identical", p["tokens_identical"])
PY
el ab
