#!/usr/bin/env bash
# H200 call of stop 45: the 10 x 50K A/B at 2,048 tokens (sessions_ab_10x50k_mtp0_mtp3_series_2048_28bd424.json)
# still had its MTP 3 runs' steps 2 and 5 at 5-8 ms in both modes, every run: the first verify executable's first two
# calls, as cmdbuf_updates_8k_series_mtp3_8d78e85.json recorded them before 3dce60d freed the plain first step's
# outputs. Which allocation still moves the verify's temporaries? 10 x 8K MTP 3 (forced), offload then resident, with
# the allocator log (the raw logs kept); then the engine, step-loop and step-copy tests compiled (engine changed at
# f967419 / 8a50d49: the ring's buffers made before a loop's first call).
LIMIT=${LIMIT:-560}
source experiments/results/probes/gpu_setup.sh
export JAX_PLATFORMS=cuda,cpu
P=experiments/results/probes
probe() {  # TAG, then the probe's env settings
  local tag=$1; shift
  env "$@" PROBE_HISTORY=8192 PROBE_NEW=48 PROBE_RUNS=3 TF_CPP_MIN_LOG_LEVEL=0 \
    TF_CPP_VMODULE=command_buffer_thunk=3,bfc_allocator=3 timeout 150 \
    python $P/cmdbuf_updates.py run 2> $OUT/cmdbuf_log_$tag.txt | tail -1
  python $P/cmdbuf_updates.py parse $OUT/cmdbuf_log_$tag.txt $OUT/cmdbuf_updates_${tag}_$R.json > /dev/null 2>&1
  python -c "import json,sys; d=json.load(open(sys.argv[1])); [print(sys.argv[2], r['run'], 'recorded', r['recorded_steps'], 'p50', r['call_p50_ms'], 'slowest', r['slowest'][:4]) for r in d['results']]" \
    $OUT/cmdbuf_updates_${tag}_$R.json $tag 2>&1 | cut -c1-1500
  gzip -f $OUT/cmdbuf_log_$tag.txt
  el "$tag"
}
probe 8k_mtp3_offload PROBE_MODE=offload PROBE_MTP=3
probe 8k_mtp3_resident PROBE_MODE=resident PROBE_MTP=3
export JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false
LEFT=$(( LIMIT - $(date +%s) + T0 - 10 ))
timeout $LEFT python -m pytest -q -p no:cacheprovider -n 4 --dist worksteal tests/test_engine.py tests/test_step_loops.py \
  tests/test_step_copies.py > $OUT/compiled_tests_engine_$R.log 2>&1
echo "tests rc $?"; tail -5 $OUT/compiled_tests_engine_$R.log
el done
