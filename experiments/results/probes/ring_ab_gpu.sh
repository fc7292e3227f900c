#!/usr/bin/env bash
# H200 call at the end of stop 41: the engine tests the ring changed, compiled, then the 10 x 50K A/B (offload vs
# resident, both with the engine's output rings, MTP 0 and MTP 3 forced), one pair each: tokens and logits identical,
# step-call p99 / median of decode and verify. Same setup as next_call_gpu.sh (GLM53_GIT_REVISION, OUT, .whl/).
LIMIT=${LIMIT:-500}
source experiments/results/probes/gpu_setup.sh
export JAX_PLATFORMS=cuda
timeout 170 python -m pytest -v -n 4 --dist worksteal -p no:cacheprovider tests/test_engine.py \
  -k "output_ring or copyback_steps or compile_once or memory_report" \
  2>&1 | grep "PASSED\|FAILED\|ERROR\|passed\|failed" > $OUT/compiled_tests_engine_ring_$R.log
cat $OUT/compiled_tests_engine_ring_$R.log | cut -c1-150
el tests
export JAX_PLATFORMS=cuda,cpu
LEFT=$(( LIMIT - $(date +%s) + T0 ))
timeout $(( LEFT - 5 )) python -m experiments.sessions_ab --config=configs/h200_bench.py --config.run.prompt_len=50000 \
  --config.run.max_new_tokens=512 --sessions=10 --pairs=1 --max_pairs=1 --mtp=0,3 --append=0 --workload=local99 \
  --budget_s=$(( LEFT / 2 )) --out=$OUT/sessions_ab_10x50k_mtp0_mtp3_ring_$R.json 2>&1 | grep "loss\|p99\|identical\|Error" | cut -c1-400
el ab
