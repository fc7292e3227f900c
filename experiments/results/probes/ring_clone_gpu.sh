#!/usr/bin/env bash
# H200 call (prepared at the end of stop 39, not yet run): the output ring from one compilation cloned through its
# serialized form (probes/ring_outputs.py clone3), against one executable: are the clones' tokens one executable's
# (the separately compiled copies of 84c6a66 were not), do they run when the compilation came from a persistent
# compilation cache (on the CPU such clones fail), and does the selection override's array in fixed buffers
# (clone3fixed) keep the calls short under local99? Same setup as next_call_gpu.sh (GLM53_GIT_REVISION, OUT, .whl/).
LIMIT=${LIMIT:-560}
source experiments/results/probes/gpu_setup.sh
export JAX_PLATFORMS=cuda,cpu
LEFT=$(( LIMIT - $(date +%s) + T0 ))
PROBE_TAG=clone10_$R PROBE_VARIANTS=default,clone3 PROBE_REPS=2 OUT=$OUT timeout $(( LEFT * 3 / 10 )) \
  python experiments/results/probes/ring_outputs.py 2>&1 | grep "^{" | cut -c1-300
el clone10
LEFT=$(( LIMIT - $(date +%s) + T0 ))
PROBE_TAG=clone10_local99_$R PROBE_WORKLOAD=local99 PROBE_VARIANTS=default,clone3,clone3fixed PROBE_REPS=2 OUT=$OUT \
  timeout $(( LEFT * 5 / 10 )) python experiments/results/probes/ring_outputs.py 2>&1 | grep "^{" | cut -c1-300
el clone10_local99
# twice with a persistent compilation cache: the second process clones executables the cache loaded
export JAX_COMPILATION_CACHE_DIR=/tmp/jax-cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
for k in 1 2; do
  LEFT=$(( LIMIT - $(date +%s) + T0 ))
  PROBE_TAG=clone1_cache${k}_$R PROBE_SESSIONS=1 PROBE_HISTORY=8192 PROBE_VARIANTS=default,clone3 PROBE_REPS=2 \
    OUT=$OUT timeout $(( LEFT / (3 - k) - 5 )) python experiments/results/probes/ring_outputs.py 2>&1 \
    | grep "^{\|Error" | cut -c1-300
  el clone1_cache$k
done
