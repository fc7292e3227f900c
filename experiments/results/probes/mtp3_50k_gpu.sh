#!/usr/bin/env bash
# H200 call planned in stop 45 (not run yet: the device was withdrawn): the 10 x 50K MTP 3 runs' steps 2 and 5
# (the first verify executable's first two calls, 4.7-7.7 ms in both modes at 28bd424,
# sessions_ab_10x50k_mtp0_mtp3_series_2048_28bd424.json) under XLA's command-buffer and allocator logs, at 50K where
# they happen (a 10 x 8K log found no recording: cmdbuf_updates_8k_mtp3_offload_47beb59.json). MODE (offload) and
# NEW (512) as the env says; run at ae76d9f or later, where a ring's first call frees the loop's first inputs before
# its executable runs: do steps 2 and 5 still record, and what was alive at step 2 that was gone by step 5?
# Then ab_series_gpu.sh with NEW=2048 PAIRS=2 MTP=3 for the p99 / median at that code.
LIMIT=${LIMIT:-560}
MODE=${MODE:-offload}; NEW=${NEW:-512}
source experiments/results/probes/gpu_setup.sh
export JAX_PLATFORMS=cuda,cpu
P=experiments/results/probes
tag=50k_mtp3_${MODE}_$NEW
env PROBE_MODE=$MODE PROBE_MTP=3 PROBE_HISTORY=50000 PROBE_NEW=$NEW PROBE_RUNS=3 TF_CPP_MIN_LOG_LEVEL=0 \
  TF_CPP_VMODULE=command_buffer_thunk=3,bfc_allocator=3 timeout $(( LIMIT - 40 )) \
  python $P/cmdbuf_updates.py run 2> $OUT/cmdbuf_log_$tag.txt | tail -1
python $P/cmdbuf_updates.py parse $OUT/cmdbuf_log_$tag.txt $OUT/cmdbuf_updates_${tag}_$R.json > /dev/null 2>&1
python -c "import json,sys; d=json.load(open(sys.argv[1])); [print(r['run'], 'recorded', r['recorded_steps'], 'p50', r['call_p50_ms'], 'slowest', r['slowest'][:6]) for r in d['results']]" \
  $OUT/cmdbuf_updates_${tag}_$R.json 2>&1 | cut -c1-1500
gzip -f $OUT/cmdbuf_log_$tag.txt
el done
