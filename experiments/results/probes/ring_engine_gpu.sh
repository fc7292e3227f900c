#!/usr/bin/env bash
# H200 call for the engine's output rings (Engine.output_ring, Steps.ring; at 84c6a66 separately compiled copies,
# reverted; since then one compilation cloned through its serialized form): the engine tests compiled (the rings are
# the engine's default on a GPU), then the host calls with the rings against one executable (probes/host_calls.py:
# default vs no_ring) at 10 x 50K offload, local99. Same setup as next_call_gpu.sh (GLM53_GIT_REVISION, OUT, .whl/).
LIMIT=${LIMIT:-560}
source experiments/results/probes/gpu_setup.sh
export JAX_PLATFORMS=cuda
timeout ${TEST_S:-300} python -m pytest -v -rf -n 4 --dist worksteal -p no:cacheprovider tests/test_engine.py \
  2>&1 | grep "PASSED\|FAILED\|ERROR\|^E \|passed\|failed" > $OUT/compiled_tests_engine_ring_$R.log
grep -c PASSED $OUT/compiled_tests_engine_ring_$R.log; grep "FAILED\|^E " $OUT/compiled_tests_engine_ring_$R.log | head -20; tail -2 $OUT/compiled_tests_engine_ring_$R.log
el tests
export JAX_PLATFORMS=cuda,cpu
LEFT=$(( LIMIT - $(date +%s) + T0 ))
PROBE_TAG=ring_clone_engine10_$R PROBE_VARIANTS=default,no_ring PROBE_REPS=${REPS:-2} OUT=$OUT timeout $(( LEFT - 5 )) \
  python experiments/results/probes/host_calls.py 2>&1 | grep "^{\|Error" | cut -c1-330
el ring10
