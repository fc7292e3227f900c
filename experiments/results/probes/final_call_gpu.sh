#!/usr/bin/env bash
# H200 call (GLM53_GIT_REVISION=<commit>, OUT set; carry .whl): the top-k's kernels compiled, XLA's dot strength
# reduction A/B in one process, the 8K decode step profiled by kernel, the offload model tests compiled.
#   1. tests/test_kernels_indexer.py compiled (JAX_PLATFORMS=cuda);
#   2. batch-1 8K decode, 512 tokens, the engine's steps compiled with xla_gpu_enable_dot_strength_reduction=false
#      against =true (XLA's default) in one process: XLA rewrites "small" matrix-vector products (the indexer's
#      wq_b, kv_a_proj, the absorbed MLA einsums) into a multiply and a reduce that run below the HBM bandwidth;
#   3. the 8K decode step profiled by kernel (launches a step after the top-k's glue moved into its kernels);
#   4. tests/test_offload_model.py compiled, while time is left.
LIMIT=${LIMIT:-500}
source experiments/results/probes/gpu_setup.sh
JAX_PLATFORMS=cuda timeout 120 python -m pytest -q -p no:cacheprovider tests/test_kernels_indexer.py 2>&1 | tail -2
el kernel tests
export JAX_PLATFORMS=cuda,cpu
timeout 170 python -m experiments.generate --config=configs/h200_bench.py --config.run.prompt_len=8192 \
  --config.run.max_new_tokens=512 --compiler_options=xla_gpu_enable_dot_strength_reduction=false \
  --baseline_compiler_options=xla_gpu_enable_dot_strength_reduction=true \
  --config.run.output_json=$OUT/generate_8k_512_dot_strength_ab_$R.json 2>&1 | grep "roofline:\|options {" | tail -3
el strength reduction ab
timeout 110 python -m experiments.profile_decode --config=configs/h200_bench.py --config.run.prompt_len=8192 \
  --config.run.max_new_tokens=32 --workload=indexer --modes=resident --out=$OUT/profile_decode_8k_model_$R.json 2>&1 \
  | grep "busy" | tail -1
el profile
LEFT=$(( LIMIT - $(date +%s) + T0 ))
[ $LEFT -ge 40 ] && JAX_PLATFORMS=cuda timeout $LEFT python -m pytest -q -p no:cacheprovider tests/test_offload_model.py 2>&1 | tail -3
el offload tests
