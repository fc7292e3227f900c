#!/usr/bin/env bash
# H200 call prepared at the end of stop 41, not yet run: what stop 41 could not check of the engine's output rings
# on the GPU. (1) The ring's own test compiled, alone (it did not finish beside others in 170-300 s), with the
# copies loaded from the tests' persistent compilation cache on its second run. (2) Batch 1 at 8K: ring against one
# executable in one process (host_calls.py default vs no_ring), and the 1,024-token generate against the README's
# 313.05 tok/s (generate_8k_1024_5451fca.json). Same setup as next_call_gpu.sh (GLM53_GIT_REVISION, OUT, .whl/).
LIMIT=${LIMIT:-560}
source experiments/results/probes/gpu_setup.sh
export JAX_PLATFORMS=cuda
for k in 1 2; do
  timeout 150 python -m pytest -v -p no:cacheprovider tests/test_engine.py -k output_ring 2>&1 \
    | grep "PASSED\|FAILED\|^E \|passed\|failed" | head -20 | tee -a $OUT/compiled_test_output_ring_$R.log
  el "ring test, run $k"
done
export JAX_PLATFORMS=cuda,cpu
PROBE_TAG=ring_engine1_$R PROBE_SESSIONS=1 PROBE_HISTORY=8192 PROBE_VARIANTS=default,no_ring PROBE_REPS=2 OUT=$OUT \
  timeout 130 python experiments/results/probes/host_calls.py 2>&1 | grep "^{\|Error" | cut -c1-300
el ring1
LEFT=$(( LIMIT - $(date +%s) + T0 ))
timeout $(( LEFT - 5 )) python -m experiments.generate --config=configs/h200_bench.py --config.run.prompt_len=8192 \
  --config.run.max_new_tokens=1024 --config.run.output_json=$OUT/generate_8k_1024_ring_$R.json 2>&1 | tail -4
el generate
