#!/usr/bin/env bash
# Where a decode step's host call goes on the H200 (profile_decode's host summary), batch 1 and 10 lanes, resident
# and offload; run from the repository root with GLM53_GIT_REVISION=<commit> and OUT=<output folder>.
set -u
export JAX_PLATFORMS=cuda,cpu
T0=$(date +%s); el() { echo "[t=$(( $(date +%s) - T0 ))s] $*"; }
for whl in .whl/ml_collections-*.whl; do [ -e "$whl" ] && python -m pip install -q --no-deps "$whl"; done
python -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v "^WARNING: Running pip" | tail -2
timeout 130 python -m experiments.profile_decode --config=configs/h200_bench.py --config.run.prompt_len=8192 \
  --config.run.max_new_tokens=32 --workload=indexer --modes=resident \
  --out=$OUT/profile_decode_8k_host_$GLM53_GIT_REVISION.json 2>&1 | grep "busy\|host \|rror" | head -16
el profile_b1
timeout 200 python -m experiments.profile_decode --config=configs/h200_bench.py --config.run.prompt_len=8192 \
  --config.run.batch=10 --config.run.max_new_tokens=32 --workload=local99 --modes=offload \
  --out=$OUT/profile_decode_8k_b10_host_$GLM53_GIT_REVISION.json 2>&1 | grep "busy\|host \|rror" | head -16
el profile_b10
