#!/usr/bin/env bash
# The next H200 call (run from the repository root on the GPU machine, with GLM53_GIT_REVISION=<commit> and
# OUT=<output folder>; carry .whl/ with the ml_collections wheel: the machine has no network). Most important first:
#   1. the 10 x 50K MTP 0 A/B with enough pairs to decide issue 11's <= 1% on the build as it is (three pairs so
#      far over two calls: 1.03 / 0.92 / 1.31%, outputs identical) and issue 9's step-call p99 / median <= 1.25;
#   2. the 50K throughput curve on the build as it is (the committed one is 2d0e02c's).
# Done at 2ccf5c9 / ed2de7b (the previous version of this script, next_call_gpu_b.sh, next_call_gpu_c.sh): batch-1
# 8K / 50K, the final padding profiled, the 8K throughput curve, the compiled decode / offload / engine tests, FP8.
source experiments/results/probes/gpu_setup.sh
export JAX_PLATFORMS=cuda,cpu
timeout 400 python -m experiments.sessions_ab --config=configs/h200_bench.py \
  --config.run.prompt_len=50000 --config.run.max_new_tokens=512 --sessions=10 --pairs=2 --max_pairs=8 \
  --budget_s=300 --mtp=0 --append=0 --workload=local99 --out=$OUT/sessions_ab_10x50k_mtp0_$R.json 2>&1 \
  | grep "^\[" | tail -10
el sessions_ab mtp0
LEFT=$(( LIMIT - $(date +%s) + T0 ))
[ $LEFT -ge 120 ] && timeout $LEFT python -m experiments.throughput --config=configs/h200_bench.py \
  --histories=50000 --new_tokens=64 --out=$OUT/throughput_50k_$R.json 2>&1 | grep -v "it/s\]" | tail -6
el throughput 50k
