#!/usr/bin/env bash
# H200 call prepared at stop 42, run at stop 43 (fe97dc0; skip_temp_pinned_fe97dc0.json: every pinned_host
# allocation segfaulted, so part 2 did not run): XLA's SKIP_TEMP (the temporaries a command buffer reads at stable
# virtual addresses, on the VMM allocator) with the engine's output rings, which keep every argument and output put.
# Together no step would record its CUDA graphs again, not even a run's first. At 902d246 the offload engine
# segfaulted allocating its pinned_host pool under SKIP_TEMP. (1) skip_temp_pinned.py: which ways of making a
# pinned_host array work under it, and the tiny offload engine against a resident one. (2) If the engine ran: the
# command-buffer log and the timing at 10 x 8K (ring against one executable). Same setup as next_call_gpu.sh.
LIMIT=${LIMIT:-560}
source experiments/results/probes/gpu_setup.sh
export JAX_PLATFORMS=cuda,cpu
P=experiments/results/probes
SKIP=--xla_gpu_command_buffer_update_mode=SKIP_TEMP
XLA_FLAGS=$SKIP timeout 200 python $P/skip_temp_pinned.py $OUT/skip_temp_pinned_$R.json 2>&1 | grep "^{\|rror" | cut -c1-300
el "pinned under SKIP_TEMP"
if grep -q '"method": "engine_tiny", "ok": true' $OUT/skip_temp_pinned_$R.json 2>/dev/null; then
  XLA_FLAGS=$SKIP TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3 PROBE_RUNS=2 PROBE_NEW=32 \
    timeout 170 python $P/cmdbuf_updates.py run 2> $OUT/cmdbuf_log_skip_temp.txt | tail -2
  python $P/cmdbuf_updates.py parse $OUT/cmdbuf_log_skip_temp.txt $OUT/cmdbuf_updates_skip_temp_$R.json 2>&1 \
    | grep -v "^warmup\|^None" | cut -c1-400 | head -12
  gzip -f $OUT/cmdbuf_log_skip_temp.txt
  el "diag SKIP_TEMP"
  LEFT=$(( LIMIT - $(date +%s) + T0 ))
  XLA_FLAGS=$SKIP PROBE_TAG=skip_temp_engine10_8k_$R PROBE_SESSIONS=10 PROBE_HISTORY=8192 PROBE_VARIANTS=default,no_ring \
    PROBE_REPS=1 OUT=$OUT timeout $(( LEFT - 5 )) python $P/host_calls.py 2>&1 | grep "^{\|Error" | cut -c1-1000
  el "host_calls SKIP_TEMP"
fi
