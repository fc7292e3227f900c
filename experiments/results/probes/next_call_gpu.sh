#!/usr/bin/env bash
# The next H200 call (run from the repository root on the GPU machine, with GLM53_GIT_REVISION=<commit> and
# OUT=<output folder>; carry .whl/ with the ml_collections wheel: the machine has no network). Most important first
# (a call can be taken back mid-run):
#   1. probes/matvec_rows.py: batch-1 8K decode with the small projections kept GEMMs (one row padded to two)
#      against XLA's strength-reduced multiply + reduce, one process (issue 11's largest known waste: ~68 us a step);
#   2. the engine and indexer-cache tests compiled on the top-k of 40ed69c-d2060e0 (test_offload_model passed at
#      c993172; test_engine, test_indexer_cache have not run compiled on it);
#   3. batch-1 decode at 50K, 1,024 tokens, on the leaner top-k (issue 11's 50K figure: 67.5-71.0% so far);
#   4. the 10 x 50K A/B at MTP 0 with plain decode of several lanes always copying (issue 9's step-call p99).
# Done before: d31264b (the MTP 3 A/B, batch-1 8K / 50K), 3df86c8-d2060e0 (the top-k profiles, 8K at 75.7 / 75.8%).
# Use `python -m pip`: the machine's bare `pip` installs for another interpreter.
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s); el() { echo "[t=$(( $(date +%s) - T0 ))s] $*"; }
LIMIT=${LIMIT:-560}
R=$GLM53_GIT_REVISION
for whl in .whl/ml_collections-*.whl; do [ -e "$whl" ] && python -m pip install -q --no-deps "$whl"; done
python -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v "^WARNING: Running pip" | tail -2
PYTHONPATH=$PWD JAX_PLATFORMS=cuda,cpu timeout 200 python experiments/results/probes/matvec_rows.py $OUT/matvec_rows_8k_$R.json 8192 512 2>&1 | tail -3
el matvec rows
JAX_PLATFORMS=cuda timeout 200 python -m pytest -q -x -p no:cacheprovider tests/test_indexer_cache.py tests/test_engine.py 2>&1 | tail -2
el engine tests
export JAX_PLATFORMS=cuda,cpu
LEFT=$(( LIMIT - $(date +%s) + T0 ))
[ $LEFT -ge 100 ] && timeout $LEFT python -m experiments.generate --config=configs/h200_bench.py --config.run.prompt_len=50000 \
  --config.run.max_new_tokens=1024 --config.run.output_json=$OUT/generate_50k_1024_$R.json 2>&1 \
  | grep "decode\|roofline\|host:" | grep -v "it/s\]" | tail -3
el generate 50k
LEFT=$(( LIMIT - $(date +%s) + T0 ))
[ $LEFT -ge 150 ] && timeout $LEFT python -m experiments.sessions_ab --config=configs/h200_bench.py \
  --config.run.prompt_len=50000 --config.run.max_new_tokens=512 --sessions=10 --pairs=1 --max_pairs=2 \
  --budget_s=$(( LEFT - 60 )) --mtp=0 --append=0 --workload=local99 --out=$OUT/sessions_ab_10x50k_mtp0_$R.json 2>&1 \
  | grep "^\[" | tail -4
el sessions_ab mtp0
