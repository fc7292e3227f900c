#!/usr/bin/env bash
# The next H200 call (run from the repository root on the GPU machine, with GLM53_GIT_REVISION=<commit> and
# OUT=<output folder>; carry .whl/ with the ml_collections wheel: the machine has no network):
#   1. batch-1 generate at 8K and 50K over 1,024 tokens: generate's JSON now holds the host's dispatch loop, the
#      step calls and the step intervals with their maximum, to tell whether the ~0.19 ms a step that 50K loses
#      against its profiled device time (3d25d55) is one stall or a steady gap;
#   3. the 10 x 50K A/B at MTP 3 forced on the one-launch experts (MTP 0 ran at 3d25d55), cut to the call.
# Use `python -m pip`: the machine's bare `pip` installs for another interpreter.
set -u
export JAX_PLATFORMS=cuda,cpu
T0=$(date +%s); el() { echo "[t=$(( $(date +%s) - T0 ))s] $*"; }
for whl in .whl/ml_collections-*.whl; do [ -e "$whl" ] && python -m pip install -q --no-deps "$whl"; done
python -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v "^WARNING: Running pip" | tail -2
for n in 8192 50000; do
  timeout 110 python -m experiments.generate --config=configs/h200_bench.py --config.run.prompt_len=$n \
    --config.run.max_new_tokens=1024 --config.run.output_json=$OUT/generate_${n}_1024_$GLM53_GIT_REVISION.json \
    2>&1 | grep "decode\|roofline\|host:\|rror" | tail -4
  el gen $n
done
# 2. where a 10-lane x 50K offload decode step's host call goes (profile_decode's host summary: PJRT's execute, XLA's
#    thunks and command buffers, the driver's launches), the step-call p99 target of issue 9.
timeout 220 python -m experiments.profile_decode --config=configs/h200_bench.py --config.run.prompt_len=50000 \
  --config.run.batch=10 --config.run.max_new_tokens=48 --workload=local99 --modes=offload \
  --out=$OUT/profile_decode_50k_b10_host_$GLM53_GIT_REVISION.json 2>&1 | grep "busy\|host \|rror" | head -16
el profile_b10
LEFT=$(( 560 - $(date +%s) + T0 ))
timeout $LEFT python -m experiments.sessions_ab --config=configs/h200_bench.py --config.run.prompt_len=50000 \
  --config.run.max_new_tokens=512 --sessions=10 --pairs=2 --max_pairs=8 --budget_s=$(( LEFT - 200 )) --mtp=3 \
  --append=0 --workload=local99 --out=$OUT/sessions_ab_10x50k_mtp3_$GLM53_GIT_REVISION.json 2>&1 | grep "^\[" | tail -8
el sessions_ab
