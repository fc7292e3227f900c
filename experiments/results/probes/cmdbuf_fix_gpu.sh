#!/usr/bin/env bash
# H200 call of stop 42, after cmdbuf_first_calls_gpu.sh found every ring decode call re-recording its CUDA graph
# (one allocation moved: the temporaries) and the separate temp allocator serializing the steps: with the arrays made
# between two steps gone (the override's sets donated, the override padded into the ring's buffer), (1) the
# command-buffer log again, the benchmarks' local99 override and the model's own selection (no override); (2) the
# timing, ring against one executable, 10 sessions x 8K; (3) the ring's compiled test.
source experiments/results/probes/gpu_setup.sh
export JAX_PLATFORMS=cuda,cpu
P=experiments/results/probes
for w in local99 indexer; do
  PROBE_WORKLOAD=$w TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3 PROBE_RUNS=2 PROBE_NEW=32 \
    timeout 120 python $P/cmdbuf_updates.py run 2> $OUT/cmdbuf_log_$w.txt | tail -2
  python $P/cmdbuf_updates.py parse $OUT/cmdbuf_log_$w.txt $OUT/cmdbuf_updates_${w}_$R.json 2>&1 | grep -v "^warmup\|^None" | cut -c1-300 | head -20
  gzip -f $OUT/cmdbuf_log_$w.txt
  el "diag $w"
done
PROBE_TAG=engine10_8k_$R PROBE_SESSIONS=10 PROBE_HISTORY=8192 PROBE_VARIANTS=default,no_ring \
  PROBE_REPS=2 OUT=$OUT timeout 140 python $P/host_calls.py 2>&1 | grep "^{\|Error" | cut -c1-420
el "host_calls"
export JAX_PLATFORMS=cuda
LEFT=$(( LIMIT - $(date +%s) + T0 ))
timeout $(( LEFT - 5 )) python -m pytest -v -p no:cacheprovider tests/test_engine.py -k output_ring 2>&1 \
  | grep "PASSED\|FAILED\|^E \|passed\|failed" | head -20 | tee -a $OUT/compiled_test_output_ring_$R.log
el "ring test"
