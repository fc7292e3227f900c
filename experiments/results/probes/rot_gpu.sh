#!/usr/bin/env bash
# H200 call: does calling the decode step through LAG + 1 separately compiled executables in turn let XLA skip the
# CUDA-graph update a call spends most of its host time in (probes/host_calls.py: rot2, rot3 against default and
# sync), at 10 x 50K offload and at batch 1, 8K. Same setup as next_call_gpu.sh (GLM53_GIT_REVISION, OUT, .whl/).
LIMIT=${LIMIT:-560}
source experiments/results/probes/gpu_setup.sh
export JAX_PLATFORMS=cuda,cpu JAX_COMPILATION_CACHE_DIR=/tmp/jax-cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
LEFT=$(( LIMIT - $(date +%s) + T0 ))
PROBE_TAG=rot10 PROBE_VARIANTS=default,rot3,sync,rot2 PROBE_REPS=2 OUT=$OUT timeout $(( LEFT * 6 / 10 )) \
  python experiments/results/probes/host_calls.py 2>&1 | grep -v "^W\|^I0\|Warning" | cut -c1-600 | tail -14
el rot10
LEFT=$(( LIMIT - $(date +%s) + T0 ))
PROBE_TAG=rot1 PROBE_SESSIONS=1 PROBE_HISTORY=8192 PROBE_VARIANTS=default,rot3,sync PROBE_REPS=2 OUT=$OUT \
  timeout $(( LEFT - 10 )) python experiments/results/probes/host_calls.py 2>&1 | grep -v "^W\|^I0\|Warning" \
  | cut -c1-600 | tail -10
el rot1
