#!/usr/bin/env bash
# The next H200 call (run from the repository root on the GPU machine, with GLM53_GIT_REVISION=<commit> and
# OUT=<output folder>; carry .whl/ with the ml_collections wheel: the machine has no network). Most important first
# (a call can be taken back mid-run):
#   1. probes/matvec_rows.py: batch-1 8K decode with the model's one-token padding (glm53.model.matmul: dots at
#      least 1,024 wide, the indexer's wq_b) against kv_a_proj_with_mqa padded too and against every small dot plain;
#   2. the decode step by kernel at 8K, the model as it is and with the token's row repeated instead of a zero row
#      (probes/profile_variant.py; compare them with `python -m experiments.compare_profiles A.json B.json`;
#      d9ae3a9's and older profiles carry no op per kernel: busy 3,387.2 us at d9ae3a9, 3,417.0 at d2060e0);
#   3. batch-1 resident decode at 8K and 50K, 1,024 tokens, on the final code (issue 11's 75% at both);
#   4. with the time left, the 10 x 50K MTP 0 A/B (issue 11's <= 1% on the fast path, issue 9's step-call p99).
# next_call_gpu_b.sh holds the call after: test_engine compiled (over 300 s), then the throughput curves.
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
export JAX_PLATFORMS=cuda,cpu
PYTHONPATH=$PWD timeout 200 python experiments/results/probes/matvec_rows.py $OUT/matvec_rows_8k_$R.json 8192 512 2>&1 | tail -5
el matvec rows
for V in model repeated_row; do
  PYTHONPATH=$PWD timeout 120 python experiments/results/probes/profile_variant.py $V --config=configs/h200_bench.py \
    --config.run.prompt_len=8192 --config.run.max_new_tokens=32 --workload=indexer --modes=resident \
    --out=$OUT/profile_decode_8k_${V}_$R.json 2>&1 | grep -i "busy" | tail -1
  mv $OUT/decode_hlo_resident.txt $OUT/decode_hlo_8k_${V}_$R.txt 2>/dev/null; gzip $OUT/decode_hlo_8k_${V}_$R.txt
  el profile $V
done
for P in 8192 50000; do
  LEFT=$(( LIMIT - $(date +%s) + T0 ))
  [ $LEFT -ge 100 ] && timeout $LEFT python -m experiments.generate --config=configs/h200_bench.py \
    --config.run.prompt_len=$P --config.run.max_new_tokens=1024 --config.run.output_json=$OUT/generate_${P}_1024_$R.json \
    2>&1 | grep "roofline:\|host:" | tail -2
  el generate $P
done
LEFT=$(( LIMIT - $(date +%s) + T0 ))
[ $LEFT -ge 150 ] && timeout $LEFT python -m experiments.sessions_ab --config=configs/h200_bench.py \
  --config.run.prompt_len=50000 --config.run.max_new_tokens=512 --sessions=10 --pairs=1 --max_pairs=3 \
  --budget_s=$(( LEFT - 60 )) --mtp=0 --append=0 --workload=local99 --out=$OUT/sessions_ab_10x50k_mtp0_$R.json 2>&1 \
  | grep "^\[" | tail -4
el sessions_ab mtp0
