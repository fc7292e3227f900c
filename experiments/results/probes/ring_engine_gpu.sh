#!/usr/bin/env bash
# H200 call for the engine's output rings (Engine.output_ring, Steps.ring): the decode-loop engine tests compiled,
# then the host calls with the rings against one executable (probes/host_calls.py: default vs no_ring) at 10 x 50K
# offload and at batch 1, 8K. Same setup as next_call_gpu.sh (GLM53_GIT_REVISION, OUT, .whl/).
LIMIT=${LIMIT:-460}
source experiments/results/probes/gpu_setup.sh
export JAX_PLATFORMS=cuda
timeout 170 python -m pytest -q -n 4 --dist worksteal -p no:cacheprovider tests/test_engine.py -k \
  "output_ring or compile_once or eight_sessions or copyback or lifecycle or fork_then or memory_report or failing_callback or mtp_offload_bit_identical" \
  2>&1 | grep -v "Warning\|warner\|compiler_params" > $OUT/compiled_tests_ring_$R.log; tail -3 $OUT/compiled_tests_ring_$R.log
el tests
export JAX_PLATFORMS=cuda,cpu
LEFT=$(( LIMIT - $(date +%s) + T0 ))
PROBE_TAG=ring_engine10_$R PROBE_VARIANTS=default,no_ring PROBE_REPS=2 OUT=$OUT timeout $(( LEFT * 6 / 10 )) \
  python experiments/results/probes/host_calls.py 2>&1 | grep "^{" | cut -c1-330
el ring10
LEFT=$(( LIMIT - $(date +%s) + T0 ))
PROBE_TAG=ring_engine1_$R PROBE_SESSIONS=1 PROBE_HISTORY=8192 PROBE_VARIANTS=default,no_ring PROBE_REPS=2 OUT=$OUT \
  timeout $(( LEFT - 5 )) python experiments/results/probes/host_calls.py 2>&1 | grep "^{" | cut -c1-330
el ring1
