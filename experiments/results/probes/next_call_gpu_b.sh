#!/usr/bin/env bash
# The H200 call after next_call_gpu.sh (same setup: GLM53_GIT_REVISION, OUT, .whl/ carried):
#   1. test_decode_dots, test_offload_model and test_engine compiled (JAX_PLATFORMS=cuda) on the final padding
#      (077eacc: only wq_b; the builds that ran compiled padded more dots). test_engine has not run to its end
#      compiled since the top-k moved its glue into its kernels (d2060e0); one process needed more than 300 s, most
#      of it compiling the tiny configs' steps
#      (CPU work: four xdist workers on the machine's 16 cores; tests/conftest.py turns GEMM autotuning off, so
#      workers sharing the GPU pick the same algorithms);
#   2. the throughput curve at 8K over 1-64 sessions, resident and offload (stale since f2a1453: issue 11).
source experiments/results/probes/gpu_setup.sh
XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_PLATFORMS=cuda timeout 400 python -m pytest -q -p no:cacheprovider -n 4 --dist worksteal -rf --durations=10 \
  tests/test_decode_dots.py tests/test_offload_model.py tests/test_engine.py 2>&1 | tail -16
el compiled tests
LEFT=$(( LIMIT - $(date +%s) + T0 ))
[ $LEFT -ge 120 ] && JAX_PLATFORMS=cuda,cpu timeout $LEFT python -m experiments.throughput --config=configs/h200_bench.py \
  --histories=8192 --new_tokens=32 --out=$OUT/throughput_8k_$R.json 2>&1 | grep -v "it/s\]" | tail -6
el throughput 8k
