#!/usr/bin/env bash
# H200 call prepared at stop 43, run at stop 44 (da1a864): where a ring decode step's temporaries go, call by call.
# Each run's first three calls record their CUDA graphs again with one allocation moved (the temporaries), with or
# without the run-object cycle (cmdbuf_updates_8k_no_cycle_ef2570b.json). next_gc_gpu.sh's run (10 x 8K offload,
# local99, 48 tokens, 3 runs) with XLA's allocator log too (bfc_allocator=3: every device allocation's size and
# address): step_allocations_1mib says where each step's temporaries landed, allocations_outside_loop_steps what was
# allocated between two runs. ~2 min after the machine starts.
VMODULE=command_buffer_thunk=3,bfc_allocator=3 TAG=8k_alloc source experiments/results/probes/next_gc_gpu.sh
python -c "import json,sys; d=json.load(open(sys.argv[1])); [print(k, v) for k, v in d['step_allocations_1mib'].items() if int(k.split()[-1]) <= 5]" \
  $OUT/cmdbuf_updates_8k_alloc_$R.json | head -40
