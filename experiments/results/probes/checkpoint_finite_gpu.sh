#!/usr/bin/env bash
# GPU call (GLM53_GIT_REVISION=<commit>, OUT set; carry .whl): after the checkpoint loader checked each weight's
# finiteness inside the program that makes it (glm53.checkpoint._arranged / _finite_rows, FP8 stacks included), the
# API, FP8-expert and HF parity tests compiled (JAX_PLATFORMS=cuda).
LIMIT=${LIMIT:-400}
source experiments/results/probes/gpu_setup.sh
export JAX_PLATFORMS=cuda
timeout 200 python -m pytest -q -p no:cacheprovider -n 4 tests/test_api.py tests/test_fp8_experts.py 2>&1 | tail -3
el api and fp8-expert tests
timeout 150 python -m pytest -q -p no:cacheprovider -n 4 tests/test_hf_parity.py 2>&1 | tail -3
el hf parity tests
