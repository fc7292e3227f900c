#!/usr/bin/env bash
# H200 call of stop 42: why each ring executable's first call of a run is slow (host_calls_ring_v1v2_engine10_b4ac251:
# steps 1-3 at 2.4-4.6 ms against a ~1.1 ms median). (1) XLA's command-buffer log placed call by call
# (cmdbuf_updates.py), as the engine is and with the temporaries in their own allocator
# (--xla_gpu_temp_buffer_use_separate_color: XLA then gives an executable's temporaries the same address at every
# call); (2) the timing of both, ring against one executable (host_calls.py), 10 sessions x 8K.
source experiments/results/probes/gpu_setup.sh
export JAX_PLATFORMS=cuda,cpu
P=experiments/results/probes
SEP=--xla_gpu_temp_buffer_use_separate_color=true
for v in default separate_temp; do
  F=""; [ $v = separate_temp ] && F=$SEP
  XLA_FLAGS="$F" TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3 PROBE_RUNS=3 \
    timeout 150 python $P/cmdbuf_updates.py run 2> $OUT/cmdbuf_log_$v.txt | tail -2
  python $P/cmdbuf_updates.py parse $OUT/cmdbuf_log_$v.txt $OUT/cmdbuf_updates_${v}_$R.json 2>&1 | cut -c1-400 | head -40
  gzip -f $OUT/cmdbuf_log_$v.txt
  el "diag $v"
done
for v in default separate_temp; do
  F=""; [ $v = separate_temp ] && F=$SEP
  XLA_FLAGS="$F" PROBE_TAG=${v}_engine10_8k_$R PROBE_SESSIONS=10 PROBE_HISTORY=8192 PROBE_VARIANTS=default,no_ring \
    PROBE_REPS=2 OUT=$OUT timeout 150 python $P/host_calls.py 2>&1 | grep "^{\|Error" | cut -c1-420
  el "host_calls $v"
done
