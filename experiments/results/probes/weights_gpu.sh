#!/usr/bin/env bash
# GPU call (GLM53_GIT_REVISION=<commit>, OUT set; carry .whl): after glm53.model read its weights without Flax's
# per-apply initialiser trace (b7df258), the kernel, model, offload-model and engine MTP tests compiled
# (JAX_PLATFORMS=cuda); profile_decode keeping its traces under --trace_dir; GLM-5's decode step traced.
LIMIT=${LIMIT:-560}
source experiments/results/probes/gpu_setup.sh
export JAX_PLATFORMS=cuda
timeout 150 python -m pytest -q -p no:cacheprovider -n 4 tests/test_kernels_*.py 2>&1 | tail -2
el kernel tests
timeout 170 python -m pytest -q -p no:cacheprovider -n 4 tests/test_api.py tests/test_offload_model.py 2>&1 | tail -2
el api and offload-model tests
timeout 120 python -m experiments.profile_decode --config=configs/tiny.py --config.run.max_new_tokens=6 \
  --workload=drift0.001 --trace_dir=/tmp/traces --out=/tmp/pd.json 2>&1 | grep "busy\|kept" | tail -4
find /tmp/traces -name "*.xplane.pb" | sort
el profile_decode
python experiments/results/probes/trace_glm5_step.py 2>&1 | tail -1
el trace probe
LEFT=$(( LIMIT - $(date +%s) + T0 ))
[ $LEFT -ge 40 ] && timeout $LEFT python -m pytest -q -p no:cacheprovider -n 4 tests/test_engine.py -k "mtp or offload" \
  2>&1 | tail -2
el engine mtp/offload tests
