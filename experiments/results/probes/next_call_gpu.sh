#!/usr/bin/env bash
# The next H200 call (run from the repository root on the GPU machine, with GLM53_GIT_REVISION=<commit> and
# OUT=<output folder>; carry .whl/ with the ml_collections wheel: the machine has no network). Most important first
# (a call can be taken back mid-run):
#   1. the 10 x 50K A/B at MTP 3 forced, without the local99 override's host round trips (d23452f); its 2-pair run
#      did not finish in 260 s, so one pair and more while --budget_s lasts;
#   2. batch-1 decode at 8K and 50K, 1,024 tokens: issue 11's roofline figures on the current build;
#   3. the 10 x 50K A/B at MTP 0 with plain decode of several lanes always copying (issue 9's step-call p99).
# Done before (902d246, ffe5736): the MTP 0 A/B, SKIP_TEMP (dropped: segfault with the pinned pool, no gain in one
# process), the copy-step rules (probes/host_calls_exact_ffe5736.json).
# Use `python -m pip`: the machine's bare `pip` installs for another interpreter.
set -u
export JAX_PLATFORMS=cuda,cpu
T0=$(date +%s); el() { echo "[t=$(( $(date +%s) - T0 ))s] $*"; }
LIMIT=${LIMIT:-560}
R=$GLM53_GIT_REVISION
for whl in .whl/ml_collections-*.whl; do [ -e "$whl" ] && python -m pip install -q --no-deps "$whl"; done
python -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v "^WARNING: Running pip" | tail -2
timeout $(( LIMIT - 200 )) python -m experiments.sessions_ab --config=configs/h200_bench.py \
  --config.run.prompt_len=50000 --config.run.max_new_tokens=512 --sessions=10 --pairs=1 --max_pairs=4 \
  --budget_s=$(( LIMIT - 320 )) --mtp=3 --append=0 --workload=local99 --out=$OUT/sessions_ab_10x50k_mtp3_$R.json 2>&1 \
  | grep "^\[" | tail -4
el sessions_ab mtp3
for n in 8192 50000; do
  LEFT=$(( LIMIT - $(date +%s) + T0 )); [ $LEFT -lt 60 ] && break
  timeout $LEFT python -m experiments.generate --config=configs/h200_bench.py --config.run.prompt_len=$n \
    --config.run.max_new_tokens=1024 --config.run.output_json=$OUT/generate_${n}_1024_$R.json 2>&1 \
    | grep "decode\|roofline\|host:" | grep -v "it/s\]" | tail -4
  el generate $n
done
LEFT=$(( LIMIT - $(date +%s) + T0 ))
[ $LEFT -ge 150 ] && timeout $LEFT python -m experiments.sessions_ab --config=configs/h200_bench.py \
  --config.run.prompt_len=50000 --config.run.max_new_tokens=512 --sessions=10 --pairs=1 --max_pairs=2 \
  --budget_s=$(( LEFT - 60 )) --mtp=0 --append=0 --workload=local99 --out=$OUT/sessions_ab_10x50k_mtp0_$R.json 2>&1 \
  | grep "^\[" | tail -4
el sessions_ab mtp0
