#!/usr/bin/env bash
# H200 call of stop 44: with the benchmark's working sets kept in one set of device buffers across runs
# (workloads.Selections), do a run's first step calls still record their CUDA graphs again? next_alloc_gpu.sh's
# log (da1a864, a fresh working set per run) showed the 139 MB of temporaries moving by 160 KiB run after run,
# behind a new 80 KiB working set. 10 x 8K offload, 48 tokens, 3 runs: local99 MTP 0 and MTP 3 (forced), then the
# model's own indexer (no override), each with the allocator log.
LIMIT=${LIMIT:-400}
source experiments/results/probes/gpu_setup.sh
export JAX_PLATFORMS=cuda,cpu
P=experiments/results/probes
probe() {  # TAG, then the probe's env settings
  local tag=$1; shift
  LEFT=$(( LIMIT - $(date +%s) + T0 ))
  env "$@" PROBE_MODE=offload PROBE_HISTORY=8192 PROBE_NEW=48 PROBE_RUNS=3 TF_CPP_MIN_LOG_LEVEL=0 \
    TF_CPP_VMODULE=command_buffer_thunk=3,bfc_allocator=3 timeout $(( LEFT - 10 )) \
    python $P/cmdbuf_updates.py run 2> $OUT/cmdbuf_log_$tag.txt | tail -1
  python $P/cmdbuf_updates.py parse $OUT/cmdbuf_log_$tag.txt $OUT/cmdbuf_updates_${tag}_$R.json > /dev/null 2>&1
  python -c "import json,sys; d=json.load(open(sys.argv[1])); [print(sys.argv[2], r['run'], 'recorded', r['recorded_steps'], 'p50', r['call_p50_ms'], 'slowest', r['slowest'][:4]) for r in d['results']]; print({k: v for k, v in d['by_run_and_step'].items() if 'decode' in k or 'verify' in k or 'draft' in k})" \
    $OUT/cmdbuf_updates_${tag}_$R.json $tag 2>&1 | cut -c1-1500
  gzip -f $OUT/cmdbuf_log_$tag.txt
  el "$tag"
}
probe 8k_series PROBE_MTP=0
probe 8k_series_mtp3 PROBE_MTP=3
probe 8k_indexer PROBE_MTP=0 PROBE_WORKLOAD=indexer
