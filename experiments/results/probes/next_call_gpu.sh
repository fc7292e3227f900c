#!/usr/bin/env bash
# The next H200 call (run from the repository root on the GPU machine, with GLM53_GIT_REVISION=<commit> and
# OUT=<output folder>; carry .whl/ with the ml_collections wheel: the machine has no network). Most important first
# (a call can be taken back mid-run):
#   1. host_calls.py at 10 x 50K: the exact copy-step rule (one copy step a page, not three) against the rule before
#      it, every step copying, and every step copying with Python's collector off; step-call p99 / median of each;
#   2. the 10 x 50K A/B at MTP 0, 2 pairs: issue 9's step-call p99 / median with the exact rule;
#   3. the 10 x 50K A/B at MTP 3 forced, one pair at least (its 2-pair run did not finish in 260 s).
# SKIP_TEMP is out: the offload engine segfaults allocating its pinned_host pool under the VMM allocator it selects
# (probes/sessions_ab_skip_temp_segfault_902d246.log), and at batch 1 it was no faster in one process.
# Use `python -m pip`: the machine's bare `pip` installs for another interpreter.
set -u
export JAX_PLATFORMS=cuda,cpu
T0=$(date +%s); el() { echo "[t=$(( $(date +%s) - T0 ))s] $*"; }
LIMIT=${LIMIT:-560}
R=$GLM53_GIT_REVISION
for whl in .whl/ml_collections-*.whl; do [ -e "$whl" ] && python -m pip install -q --no-deps "$whl"; done
python -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v "^WARNING: Running pip" | tail -2
PROBE_TAG=exact_$R PROBE_VARIANTS=default,old_rule,always_copy,always_copy_gc_off timeout 200 \
  python experiments/results/probes/host_calls.py 2>&1 | grep "^{" | python -c "
import json, sys
for l in sys.stdin:
    d = json.loads(l); print(d['variant'], round(d['tok_s']), 'p99/p50 %.2f' % d['p99/p50'], 'copy', d['copy_steps'],
                             d['copy_call_med'], d['free_call_med'])"
el host_calls
ab() {  # $1: name, $2: MTP depth, $3: pairs, $4: budget_s
  LEFT=$(( LIMIT - $(date +%s) + T0 )); [ $LEFT -lt 120 ] && return
  timeout $LEFT python -m experiments.sessions_ab --config=configs/h200_bench.py \
    --config.run.prompt_len=50000 --config.run.max_new_tokens=512 --sessions=10 --pairs=1 --max_pairs=$3 \
    --budget_s=$4 --mtp=$2 --append=0 --workload=local99 --out=$OUT/sessions_ab_10x50k_$1_$R.json 2>&1 \
    | grep "^\[" | tail -4
  el sessions_ab $1
}
ab mtp0 0 2 150
ab mtp3 3 3 $(( LIMIT - $(date +%s) + T0 - 120 ))
