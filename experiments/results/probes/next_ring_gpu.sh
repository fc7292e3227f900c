#!/usr/bin/env bash
# H200 call prepared at stops 41-42, run at stop 43 (fe97dc0; its generate compiled inside the timed run, fixed at
# c398145, rerun in next_batch1_gpu.sh): what is left to check of the engine's output rings on the GPU.
# (1) The ring's own test compiled, alone (it did not finish beside others in 170-300 s, nor alone in 180 s at
# 3bb4d37): a run of its own with most of the call. (2) Batch 1 at 8K: the 1,024-token generate against the README's
# 313.05 tok/s (generate_8k_1024_5451fca.json). Same setup as next_call_gpu.sh (GLM53_GIT_REVISION, OUT, .whl/).
LIMIT=${LIMIT:-560}
source experiments/results/probes/gpu_setup.sh
export JAX_PLATFORMS=cuda
timeout 380 python -m pytest -v -p no:cacheprovider tests/test_engine.py -k output_ring 2>&1 \
  | grep "PASSED\|FAILED\|^E \|passed\|failed" | head -20 | tee -a $OUT/compiled_test_output_ring_$R.log
el "ring test"
export JAX_PLATFORMS=cuda,cpu
LEFT=$(( LIMIT - $(date +%s) + T0 ))
timeout $(( LEFT - 5 )) python -m experiments.generate --config=configs/h200_bench.py --config.run.prompt_len=8192 \
  --config.run.max_new_tokens=1024 --config.run.output_json=$OUT/generate_8k_1024_ring_$R.json 2>&1 | tail -4
el generate
