#!/usr/bin/env bash
# H200 call of stop 42, last: the 10 x 50K A/B (offload vs resident, both with the engine's output rings, MTP 0 and
# MTP 3 forced, one pair each) with nothing allocated between two ring steps (3bb4d37 on): tokens and logits
# identical, step-call p99 / median; then, in what time is left, the 10 x 8K ring against one executable
# (host_calls.py, one repetition).
LIMIT=${LIMIT:-520}
source experiments/results/probes/gpu_setup.sh
export JAX_PLATFORMS=cuda,cpu
timeout 330 python -m experiments.sessions_ab --config=configs/h200_bench.py --config.run.prompt_len=50000 \
  --config.run.max_new_tokens=512 --sessions=10 --pairs=1 --max_pairs=1 --mtp=0,3 --append=0 --workload=local99 \
  --budget_s=150 --out=$OUT/sessions_ab_10x50k_mtp0_mtp3_ring_$R.json 2>&1 | grep "loss\|p99\|identical\|Error" | cut -c1-400
el ab
LEFT=$(( LIMIT - $(date +%s) + T0 ))
PROBE_TAG=engine10_8k_$R PROBE_SESSIONS=10 PROBE_HISTORY=8192 PROBE_VARIANTS=default,no_ring \
  PROBE_REPS=1 OUT=$OUT timeout $(( LEFT - 5 )) python experiments/results/probes/host_calls.py 2>&1 | grep "^{\|Error" | cut -c1-1000
el "host_calls"
