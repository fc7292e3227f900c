#!/usr/bin/env bash
# The next H200 call (run from the repository root on the GPU machine, with GLM53_GIT_REVISION=<commit> and
# OUT=<output folder>; carry .whl/ with the ml_collections wheel: the machine has no network). Most important first
# (a call can be taken back mid-run):
#   1. probes/matvec_rows.py: batch-1 8K decode with the model's one-token padding (glm53.model.matmul: dots at
#      least 1,024 wide, the indexer's wq_b) against kv_a_proj_with_mqa padded too and against every small dot plain;
#   2. the decode step by kernel at 8K (kernel count and busy time against profile_decode_8k_model_{d2060e0,d9ae3a9});
#   3. compiled tests: test_decode_dots, test_engine (it needs more than 300 s compiled: give it a call of its own
#      if this one runs short).
# Done before: 9ad9454 (every small Linear padded: +2.7%; batch-1 50K 75.9%; 10 x 50K MTP 0 A/B, 2 pairs),
# 26d9ee4 (the head einsums padded too: no gain), d9ae3a9 (the router and other narrow dots padded: they lost).
# Use `python -m pip`: the machine's bare `pip` installs for another interpreter.
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s); el() { echo "[t=$(( $(date +%s) - T0 ))s] $*"; }
LIMIT=${LIMIT:-560}
R=$GLM53_GIT_REVISION
for whl in .whl/ml_collections-*.whl; do [ -e "$whl" ] && python -m pip install -q --no-deps "$whl"; done
python -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v "^WARNING: Running pip" | tail -2
PYTHONPATH=$PWD JAX_PLATFORMS=cuda,cpu timeout 240 python experiments/results/probes/matvec_rows.py $OUT/matvec_rows_8k_$R.json 8192 512 2>&1 | tail -6
el matvec rows
LEFT=$(( LIMIT - $(date +%s) + T0 ))
[ $LEFT -ge 90 ] && JAX_PLATFORMS=cuda,cpu timeout $LEFT python -m experiments.profile_decode --config=configs/h200_bench.py \
  --config.run.prompt_len=8192 --config.run.max_new_tokens=32 --workload=indexer --modes=resident \
  --out=$OUT/profile_decode_8k_model_$R.json 2>&1 | grep -i "kernels\|busy" | tail -4
el profile
LEFT=$(( LIMIT - $(date +%s) + T0 ))
JAX_PLATFORMS=cuda timeout $LEFT python -m pytest -q -p no:cacheprovider -rf tests/test_decode_dots.py \
  tests/test_engine.py 2>&1 | tail -4
el compiled tests
