#!/usr/bin/env bash
# A short H200 call (same setup as next_call_gpu.sh: GLM53_GIT_REVISION, OUT, .whl/ carried), most important first:
#   1. the 10 x 50K MTP 0 A/B on the build as it is (issue 11's <= 1% on the fast path, issue 9's step-call p99);
#   2. batch-1 8K decode with FP8 experts beside the bf16 figure (issue 11; last measured at 62932c1).
LIMIT=${LIMIT:-420}
source experiments/results/probes/gpu_setup.sh
export JAX_PLATFORMS=cuda,cpu
LEFT=$(( LIMIT - $(date +%s) + T0 ))
timeout $(( LEFT - 90 )) python -m experiments.sessions_ab --config=configs/h200_bench.py \
  --config.run.prompt_len=50000 --config.run.max_new_tokens=512 --sessions=10 --pairs=1 --max_pairs=4 \
  --budget_s=$(( LEFT - 250 )) --mtp=0 --append=0 --workload=local99 --out=$OUT/sessions_ab_10x50k_mtp0_$R.json 2>&1 \
  | grep "^\[" | tail -6
el sessions_ab mtp0
LEFT=$(( LIMIT - $(date +%s) + T0 ))
[ $LEFT -ge 60 ] && timeout $LEFT python -m experiments.generate --config=configs/h200_bench.py --expert_weights=fp8 \
  --config.run.prompt_len=8192 --config.run.max_new_tokens=1024 --config.run.output_json=$OUT/generate_8k_1024_fp8_experts_$R.json \
  2>&1 | grep "roofline:\|host:" | tail -2
el generate fp8
