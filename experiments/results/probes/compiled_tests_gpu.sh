#!/usr/bin/env bash
# GPU call (GLM53_GIT_REVISION=<commit>, OUT set; carry .whl): the kernel, API, offload-model, offload-state and the
# engine's MTP and offload tests compiled (JAX_PLATFORMS=cuda, kernels compiled, not interpreted), four workers
# sharing the GPU (tests/conftest.py turns XLA's GEMM autotuning off for them, so both cache modes compile the same
# products the same way). Written in stop 68; first run at 661a58c on an H100 (182 + 91 + 9 passed in 363 s:
# compiled_tests_h100_661a58c.log), before ab_series_gpu.sh on the same warm machine.
LIMIT=${LIMIT:-560}
# ONLY picks the groups (default all four, in this order): kernels, offload, formats, engine. Stop 72's H100 ran
# kernels and offload at e834a9d and had no time for the rest; ONLY=formats,engine ran them at 6876354 (LIMIT=540:
# 64 + 9 passed in 253 s, compiled_tests_h100_6876354.log).
# Stop 79 ran ONLY=kernels,offload,engine at 5343805 on an H100 (LIMIT=570: 189 + 93 + 9 passed in 236 s,
# compiled_tests_kernels_offload_engine_h100_5343805.log).
ONLY=${ONLY:-kernels,offload,formats,engine}
source experiments/results/probes/gpu_setup.sh
export JAX_PLATFORMS=cuda
nvidia-smi --query-gpu=name --format=csv,noheader
# Each group prints its count line and the name of every failing test (-rfE): at e834a9d a bare count line told
# only that one test of 49 had failed, and finding which took a second call.
tests() { timeout "$1" python -m pytest -q -rfE -p no:cacheprovider -n 4 "${@:2}" 2>&1 \
  | grep -E "^(FAILED|ERROR) |[0-9]+ (passed|failed|error)"; }
want() { [[ ",$ONLY," == *",$1,"* ]]; }
want kernels && { tests 150 tests/test_kernels_*.py; el kernel tests; }
want offload && { tests 190 tests/test_api.py tests/test_offload_model.py tests/test_offload_state.py
  el api, offload-model and offload-state tests; }
# Stop 71 stored bf16 and fp8 planes and keys as their bits (kernels_pallas.kv_formats): the formats, the steps'
# in-place writes, the indexer-key cache and saves, and the Triton lowering of the narrow planes at the target size.
# First run at e834a9d on an H100 (LIMIT=380): 49 of its 64 tests done when 150 s ran out, one failed (a test's own
# fault, mended in 73ed40b: compiled_tests_h100_e834a9d.log, compiled_tests_formats_h100_e834a9d.log); hence 240 s.
# At 6876354 all 64 passed in 160 s.
want formats && { tests 240 tests/test_kv_formats.py tests/test_step_copies.py tests/test_indexer_cache.py \
  tests/test_session_io.py tests/test_pool_scale.py; el formats, step-copy, indexer-cache, session-io and pool-scale tests; }
LEFT=$(( LIMIT - $(date +%s) + T0 ))
want engine && [ $LEFT -ge 40 ] && { tests $LEFT tests/test_engine.py -k "mtp or offload"; el engine mtp/offload tests; }
true
