#!/usr/bin/env bash
# H200 call prepared at stop 42, run at stop 43 (fe97dc0; its MTP 3 run did not finish in 175 s and ran again in
# next_batch1_gpu.sh): what sets the 10 x 50K offload decode's step-call tail since 3bb4d37
# (p50 1.19 ms, p99 1.77, the slow calls 1.7-1.9 ms after each run's first three; resident 1.10 / 1.31). XLA's
# command-buffer log placed call by call (cmdbuf_updates.py) for offload and resident, local99, 256 tokens, 2 runs:
# do the tail calls record their CUDA graphs again (and which allocation moved), or is it elsewhere? Then MTP 3
# forced (verify), offload. Same setup as next_call_gpu.sh (GLM53_GIT_REVISION, OUT, .whl/).
LIMIT=${LIMIT:-560}
source experiments/results/probes/gpu_setup.sh
export JAX_PLATFORMS=cuda,cpu
P=experiments/results/probes
for v in offload:0 resident:0 offload:3; do
  m=${v%:*}; d=${v#*:}
  PROBE_MODE=$m PROBE_MTP=$d PROBE_HISTORY=50000 PROBE_NEW=256 PROBE_RUNS=2 TF_CPP_MIN_LOG_LEVEL=0 \
    TF_CPP_VMODULE=command_buffer_thunk=3 timeout 175 python $P/cmdbuf_updates.py run 2> $OUT/cmdbuf_log_${m}_mtp${d}.txt | tail -2
  python $P/cmdbuf_updates.py parse $OUT/cmdbuf_log_${m}_mtp${d}.txt $OUT/cmdbuf_updates_50k_${m}_mtp${d}_$R.json 2>&1 \
    | grep -v "^warmup\|^None" | cut -c1-700 | head -20
  gzip -f $OUT/cmdbuf_log_${m}_mtp${d}.txt
  el "diag $v"
done
