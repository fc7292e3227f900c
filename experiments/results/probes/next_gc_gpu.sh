#!/usr/bin/env bash
# H200 call at stop 43: do a run's first calls still record their CUDA graphs once a generate leaves no device
# arrays to Python's collector (the decode loop's run object was a reference cycle until this revision, holding
# its inputs and last outputs into the next generate)? XLA's command-buffer log call by call (cmdbuf_updates.py),
# 10 x 8K offload, local99, 48 tokens, 3 runs after the warm-up. next_alloc_gpu.sh runs it with more logs
# (VMODULE) under another name (TAG).
LIMIT=${LIMIT:-230}
VMODULE=${VMODULE:-command_buffer_thunk=3}
TAG=${TAG:-8k_no_cycle}
source experiments/results/probes/gpu_setup.sh
export JAX_PLATFORMS=cuda,cpu
P=experiments/results/probes
LEFT=$(( LIMIT - $(date +%s) + T0 ))
PROBE_MODE=offload PROBE_HISTORY=8192 PROBE_NEW=48 PROBE_RUNS=3 TF_CPP_MIN_LOG_LEVEL=0 \
  TF_CPP_VMODULE=$VMODULE timeout $(( LEFT - 15 )) python $P/cmdbuf_updates.py run 2> $OUT/cmdbuf_log_$TAG.txt | tail -2
python $P/cmdbuf_updates.py parse $OUT/cmdbuf_log_$TAG.txt $OUT/cmdbuf_updates_${TAG}_$R.json 2>&1 \
  | grep -v "^warmup\|^None" | cut -c1-600 | head -24
gzip -f $OUT/cmdbuf_log_$TAG.txt
el "diag"
