#!/usr/bin/env bash
# H200 call prepared at stop 43, not yet run: where a ring decode step's temporaries go, call by call. Each run's
# first three calls record their CUDA graphs again with one allocation moved (the temporaries), with or without the
# run-object cycle (cmdbuf_updates_8k_no_cycle_ef2570b.json). XLA's allocator log (bfc_allocator=3: every device
# allocation's size and address) beside the command-buffer log, 10 x 8K offload, local99, 48 tokens, 3 runs:
# step_allocations_1mib says where each step's temporaries landed, allocations_outside_loop_steps what was
# allocated between two runs. ~2 min after the machine starts.
LIMIT=${LIMIT:-230}
source experiments/results/probes/gpu_setup.sh
export JAX_PLATFORMS=cuda,cpu
P=experiments/results/probes
LEFT=$(( LIMIT - $(date +%s) + T0 ))
PROBE_MODE=offload PROBE_HISTORY=8192 PROBE_NEW=48 PROBE_RUNS=3 TF_CPP_MIN_LOG_LEVEL=0 \
  TF_CPP_VMODULE=command_buffer_thunk=3,bfc_allocator=3 timeout $(( LEFT - 15 )) python $P/cmdbuf_updates.py run \
  2> $OUT/cmdbuf_log_alloc.txt | tail -2
python $P/cmdbuf_updates.py parse $OUT/cmdbuf_log_alloc.txt $OUT/cmdbuf_updates_8k_alloc_$R.json 2>&1 \
  | grep -v "^warmup\|^None" | cut -c1-600 | head -24
python -c "import json,sys; d=json.load(open(sys.argv[1])); [print(k, v) for k, v in d['step_allocations_1mib'].items() if int(k.split()[-1]) <= 5]" \
  $OUT/cmdbuf_updates_8k_alloc_$R.json | head -40
gzip -f $OUT/cmdbuf_log_alloc.txt
el "diag"
