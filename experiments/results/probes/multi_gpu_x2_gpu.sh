#!/usr/bin/env bash
# Issue 15, part 1, for the first session lent `nvidia-h200-x2` (written in stop 45, not run yet; its commands ran on
# 2 CPU devices with configs/tiny.py): configs/h200_bench.py on 2 stages and on tp=2. Each layout: generate against
# one device (tokens; logits bit-identical for stages, within 1e-5 relative for tp), then the resident / offload A/B
# in interleaved pairs (offload_ab, local99 and the model's own indexer), and the same A/B on one device as the
# same-build baseline. PROMPT (8192) and PAIRS (2) from the env; each step under what is left of LIMIT.
LIMIT=${LIMIT:-560}
PROMPT=${PROMPT:-8192}; PAIRS=${PAIRS:-2}
source experiments/results/probes/gpu_setup.sh
export JAX_PLATFORMS=cuda,cpu
left() { echo $(( LIMIT - $(date +%s) + T0 - 10 )); }
C="--config=configs/h200_bench.py --config.run.prompt_len=$PROMPT"
for layout in "stages=2" "tp=2"; do
  tag=${layout/=/}
  timeout $(left) python -m experiments.generate $C --config.mesh.$layout --config.run.max_new_tokens=64 \
    --compare_one_device=16 2>&1 | grep "vs one device\|roofline:\|Error" | cut -c1-400
  el "generate $tag"
  timeout $(left) python -m experiments.offload_ab $C --config.mesh.$layout --pairs=$PAIRS \
    --workloads=local99,indexer --out=$OUT/offload_ab_${PROMPT}_${tag}_$R.json 2>&1 | grep "pair\|Error" | cut -c1-300
  el "offload_ab $tag"
done
CUDA_VISIBLE_DEVICES=0 timeout $(left) python -m experiments.offload_ab $C --pairs=$PAIRS --workloads=local99,indexer \
  --out=$OUT/offload_ab_${PROMPT}_one_device_$R.json 2>&1 | grep "pair\|Error" | cut -c1-300
el "offload_ab one device"
