# One GPU call (stop 59): the free-memory admission on a real device (.probe/gpu_fit.py, kept beside this script as
# gpu_fit.py) and the weight-loading, capacity and FP8 tests compiled for the GPU (JAX_PLATFORMS=cuda, kernels not
# interpreted). Logs go to $OUT.
source experiments/results/probes/gpu_setup.sh
el "fit probe"
timeout 200 python experiments/results/probes/gpu_fit.py 2>&1 | grep -v "^WARNING" | tee $OUT/gpu_fit_$R.log
el "compiled tests"
JAX_PLATFORMS=cuda timeout $(( LIMIT - $(date +%s) + T0 - 10 )) python -m pytest -q -x -p no:cacheprovider \
  tests/test_capacity.py tests/test_fp8_experts.py tests/test_hf_parity.py tests/test_sharding.py tests/test_engine.py \
  -k "memory or admission or fit or capacity or fp8 or place or parity or hf" 2>&1 | tail -40 | tee $OUT/loading_tests_cuda_$R.log
el "done"
