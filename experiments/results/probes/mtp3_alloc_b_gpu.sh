#!/usr/bin/env bash
# H200 call of stop 45, after mtp3_alloc_gpu.sh: its offload probe was cut by its own 150 s limit while compiling, and
# the compiled tests by the call's limit (29 of 34 run, one failed, its name cut off with the summary). Both again,
# side by side to fit the session's last device time: the offload probe (half the GPU's memory preallocated) in the
# background, the tests (no preallocation, failures named) in the foreground. The probe's timings suffer from the
# tests beside it; what it is for, which calls record their CUDA graphs and where the temporaries go, does not.
LIMIT=${LIMIT:-560}
source experiments/results/probes/gpu_setup.sh
P=experiments/results/probes
tag=8k_mtp3_offload
( env JAX_PLATFORMS=cuda,cpu XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 PROBE_MODE=offload PROBE_MTP=3 PROBE_HISTORY=8192 \
    PROBE_NEW=48 PROBE_RUNS=3 TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3,bfc_allocator=3 \
    timeout $(( LIMIT - 60 )) python $P/cmdbuf_updates.py run 2> $OUT/cmdbuf_log_$tag.txt | tail -1 ) &
PROBE=$!
JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false timeout $(( LIMIT - 70 )) python -m pytest -q -rfE --tb=short \
  -p no:cacheprovider -n 4 --dist worksteal --durations=8 tests/test_engine.py tests/test_step_loops.py \
  tests/test_step_copies.py > $OUT/compiled_tests_engine_$R.log 2>&1
echo "tests rc $?"; grep -v "Warning\|warner" $OUT/compiled_tests_engine_$R.log | tail -40 | cut -c1-400
el tests
wait $PROBE
python $P/cmdbuf_updates.py parse $OUT/cmdbuf_log_$tag.txt $OUT/cmdbuf_updates_${tag}_$R.json > /dev/null 2>&1
python -c "import json,sys; d=json.load(open(sys.argv[1])); [print(r['run'], 'recorded', r['recorded_steps'], 'p50', r['call_p50_ms'], 'slowest', r['slowest'][:4]) for r in d['results']]" \
  $OUT/cmdbuf_updates_${tag}_$R.json 2>&1 | cut -c1-1500
gzip -f $OUT/cmdbuf_log_$tag.txt
el done
