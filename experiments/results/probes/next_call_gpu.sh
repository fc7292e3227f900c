#!/usr/bin/env bash
# The next H200 call (run from the repository root on the GPU machine, with GLM53_GIT_REVISION=<commit> and
# OUT=<output folder>; carry .whl/ with the ml_collections wheel: the machine has no network). Most important first
# (a call can be taken back mid-run):
#   1. the 10 x 50K A/B at MTP 0 on the local99 override without its host round trips (d23452f), default flags:
#      does the step-call p99 / median of issue 9 come under 1.25 now?
#   2. the same with --xla_gpu_command_buffer_update_mode=SKIP_TEMP (23230c7: batch-1 step calls 2.24 -> 1.99 ms);
#   3. batch-1 8K with and without SKIP_TEMP in one process (experiments.generate --baseline_compiler_options: the
#      same autotuned GEMMs on both sides, so tokens and logits must be identical; 23230c7's pair ran in two
#      processes and parted at token 22), both on the VMM allocator the process-wide flag selects;
#   4. the 10 x 50K A/B at MTP 3 forced, if the call's time lasts.
# Use `python -m pip`: the machine's bare `pip` installs for another interpreter.
set -u
export JAX_PLATFORMS=cuda,cpu
T0=$(date +%s); el() { echo "[t=$(( $(date +%s) - T0 ))s] $*"; }
LIMIT=${LIMIT:-560}
SKIP="--xla_gpu_command_buffer_update_mode=SKIP_TEMP"
for whl in .whl/ml_collections-*.whl; do [ -e "$whl" ] && python -m pip install -q --no-deps "$whl"; done
python -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v "^WARNING: Running pip" | tail -2
ab() {  # $1: name, $2: XLA_FLAGS, $3: MTP depth, $4: pairs
  LEFT=$(( LIMIT - $(date +%s) + T0 )); [ $LEFT -lt 90 ] && return
  XLA_FLAGS="$2" timeout $LEFT python -m experiments.sessions_ab --config=configs/h200_bench.py \
    --config.run.prompt_len=50000 --config.run.max_new_tokens=512 --sessions=10 --pairs=$4 --max_pairs=$4 --mtp=$3 \
    --append=0 --workload=local99 --out=$OUT/sessions_ab_10x50k_$1_$GLM53_GIT_REVISION.json 2>&1 | grep "^\[" | tail -6
  el sessions_ab $1
}
ab mtp0 "" 0 2
ab mtp0_skip_temp "$SKIP" 0 2
LEFT=$(( LIMIT - $(date +%s) + T0 ))
[ $LEFT -ge 120 ] && XLA_FLAGS="$SKIP" timeout 150 python -m experiments.generate --config=configs/h200_bench.py \
  --config.run.prompt_len=8192 --config.run.max_new_tokens=512 \
  --compiler_options=xla_gpu_command_buffer_update_mode=SKIP_TEMP \
  --baseline_compiler_options=xla_gpu_command_buffer_update_mode=ALWAYS_UPDATE \
  --config.run.output_json=$OUT/generate_8k_512_skip_temp_ab_$GLM53_GIT_REVISION.json \
  2>&1 | grep "decode\|roofline\|host:\|options\|rror" | tail -8
el gen_ab
ab mtp3 "" 3 2
