#!/usr/bin/env bash
# H200 call at stop 43: batch 1 at 8K and 50K (1,024 tokens, resident, as the README's 5451fca figures) now that the
# model's steps keep the rings' executables for every engine (``Steps.ring``): at fe97dc0 each glm53.generate call
# compiled them again, inside the timed run (generate_8k_1024_ring_fe97dc0.json: 7.3 s of 10.7). Then the 50K
# command-buffer log of MTP 3 forced, offload (next_tail_gpu.sh's third run, which 175 s did not finish).
LIMIT=${LIMIT:-560}
source experiments/results/probes/gpu_setup.sh
export JAX_PLATFORMS=cuda,cpu
for n in 8192:8k 50000:50k; do
  timeout 170 python -m experiments.generate --config=configs/h200_bench.py --config.run.prompt_len=${n%:*} \
    --config.run.max_new_tokens=1024 --config.run.output_json=$OUT/generate_${n#*:}_1024_ring_$R.json 2>&1 | tail -3
  el "generate ${n#*:}"
done
P=experiments/results/probes
LEFT=$(( LIMIT - $(date +%s) + T0 ))
PROBE_MODE=offload PROBE_MTP=3 PROBE_HISTORY=50000 PROBE_NEW=256 PROBE_RUNS=2 TF_CPP_MIN_LOG_LEVEL=0 \
  TF_CPP_VMODULE=command_buffer_thunk=3 timeout $(( LEFT - 15 )) python $P/cmdbuf_updates.py run 2> $OUT/cmdbuf_log_offload_mtp3.txt | tail -2
python $P/cmdbuf_updates.py parse $OUT/cmdbuf_log_offload_mtp3.txt $OUT/cmdbuf_updates_50k_offload_mtp3_$R.json 2>&1 \
  | grep -v "^warmup\|^None" | cut -c1-700 | head -20
gzip -f $OUT/cmdbuf_log_offload_mtp3.txt
el "diag offload:3"
