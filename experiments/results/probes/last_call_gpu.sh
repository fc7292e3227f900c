#!/usr/bin/env bash
# H200 (GLM53_GIT_REVISION, OUT; carry .whl): the top-k kernels compiled, the 8K decode step profiled by kernel,
# the offload model tests compiled while time is left.
LIMIT=${LIMIT:-230}
source experiments/results/probes/gpu_setup.sh
JAX_PLATFORMS=cuda timeout 100 python -m pytest -q -p no:cacheprovider tests/test_kernels_indexer.py 2>&1 | tail -1
el kernel tests
JAX_PLATFORMS=cuda,cpu timeout 100 python -m experiments.profile_decode --config=configs/h200_bench.py \
  --config.run.prompt_len=8192 --config.run.max_new_tokens=32 --workload=indexer --modes=resident \
  --out=$OUT/profile_decode_8k_model_$R.json 2>&1 | grep "busy" | tail -1
el profile
LEFT=$(( LIMIT - $(date +%s) + T0 ))
[ $LEFT -ge 30 ] && JAX_PLATFORMS=cuda timeout $LEFT python -m pytest -q -x -p no:cacheprovider tests/test_offload_model.py 2>&1 | tail -1
el offload tests
