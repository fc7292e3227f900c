#!/usr/bin/env bash
# H200 call of stop 46: what the slow step calls of a 10 x 50K MTP 3 run do on the host (call_jitter.py: each
# call's thread CPU time and context switches, the machine's steal time; default, spinning reads, LAG 1, LAG 0), after the
# 2,048-token A/B at d4f22e4 (sessions_ab_10x50k_mtp3_series_2048_d4f22e4.json) found offload p99 / median 1.84 and
# 2.59, resident 1.82 and 1.82, with the step interval at 1.30-1.41.
LIMIT=${LIMIT:-560}
source experiments/results/probes/gpu_setup.sh
export JAX_PLATFORMS=cuda,cpu
timeout $(( LIMIT - 30 )) python experiments/results/probes/call_jitter.py call_jitter_50k_mtp3_${TAG:+${TAG}_}$R.json 2>&1 \
  | grep -v "^prefill:" | cut -c1-1200
el done
# Stop 46's second call, from dde4f65 on (the engine's reads poll on GPUs): PROBE_VARIANTS=blocking,spin PROBE_REPS=3
# LIMIT=280, the JSON written after every run.
# Stop 54, run in stop 55 at 24d90f4 (H100) and 4bcd68d (H200): the engine's polls keep their core now
# (os.sched_yield) instead of sleeping at each poll (time.sleep(0)); the two in one process, interleaved:
#   GLM53_GIT_REVISION=<rev> PROBE_VARIANTS=default,sleep_poll PROBE_REPS=2 TAG=poll LIMIT=370 \
#     bash experiments/results/probes/call_jitter_gpu.sh
# Stop 50 (no device lent; for the next session): whether the regimes of slow calls follow the dispatching thread
# from core to core (each call's core is recorded now) and go when it is held on one:
#   GLM53_GIT_REVISION=<rev> PROBE_VARIANTS=default,pinned,blocking PROBE_REPS=3 LIMIT=400 \
#     bash experiments/results/probes/call_jitter_gpu.sh
