#!/usr/bin/env bash
# H200 call: the decode step as N executables in turn, each writing into donated output buffers it wrote N steps
# earlier (probes/ring_outputs.py), against the engine's loop: does the host call skip XLA's CUDA-graph update?
# 10 x 50K offload and batch 1 at 8K. Same setup as next_call_gpu.sh (GLM53_GIT_REVISION, OUT, .whl/).
LIMIT=${LIMIT:-560}
source experiments/results/probes/gpu_setup.sh
export JAX_PLATFORMS=cuda,cpu JAX_COMPILATION_CACHE_DIR=/tmp/jax-cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
LEFT=$(( LIMIT - $(date +%s) + T0 ))
PROBE_TAG=ring10 PROBE_VARIANTS=default,ring3,ring4 PROBE_REPS=3 OUT=$OUT timeout $(( LEFT * 6 / 10 )) \
  python experiments/results/probes/ring_outputs.py 2>&1 | grep "^{" | cut -c1-420
el ring10
LEFT=$(( LIMIT - $(date +%s) + T0 ))
PROBE_TAG=ring1 PROBE_SESSIONS=1 PROBE_HISTORY=8192 PROBE_VARIANTS=default,ring3 PROBE_REPS=3 OUT=$OUT \
  timeout $(( LEFT - 10 )) python experiments/results/probes/ring_outputs.py 2>&1 | grep "^{" | cut -c1-420
el ring1
