#!/usr/bin/env bash
# Stop 76: why each offload ring executable's first call of a decode loop takes ~8 ms at one session (8K history)
# where resident's takes ~1.7 ms (throughput_8k_slow_calls_w72_h100_86e22e0.json: steps 1-3 and 51-53). XLA's
# command-buffer log and the device allocations, placed call by call (cmdbuf_updates.py), one session, both modes.
source experiments/results/probes/gpu_setup.sh
export JAX_PLATFORMS=cuda,cpu
P=experiments/results/probes
# the card in the names (the 3743e1f files were renamed so after the run)
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o 'H[0-9]\+' | head -1 | tr H h)
for mode in offload resident; do
  NAME=cmdbuf_one_session_${mode}_${GPU:-gpu}_$R
  TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3,bfc_allocator=3 PROBE_SESSIONS=1 PROBE_HISTORY=8192 \
    PROBE_NEW=${PROBE_NEW:-64} PROBE_RUNS=3 PROBE_MODE=$mode timeout ${RUN_S:-240} python $P/cmdbuf_updates.py run \
    2> $OUT/$NAME.txt | tail -2
  python $P/cmdbuf_updates.py parse $OUT/$NAME.txt $OUT/$NAME.json 2>&1 | cut -c1-600 | head -40
  gzip -f $OUT/$NAME.txt
  el "$mode done"
done
