#!/usr/bin/env bash
# The next H200 call (run from the repository root on the GPU machine, with GLM53_GIT_REVISION=<commit> and
# OUT=<output folder>; carry .whl/ with the ml_collections wheel: the machine has no network).
# The 10 x 50K MTP 0 A/B twice on one machine: with XLA's heuristic GEMM algorithms (--xla_gpu_autotune_level=0:
# both modes' programs then take the same algorithm for the same product; timed autotuning picks per program, and
# a product whose fusion differs between the modes, or a busy GPU while it times, can leave the two modes with
# different GEMMs, a difference that is no part of offloading and that no number of pairs in one process averages
# out), then with the default autotuning, to see whether the choice moves the loss (ee2727c's 8 pairs with the
# default: 1.28% pooled, undecided on a host whose runs of one mode scattered by 3-4%).
# Ran at 57a4fc8: the heuristic GEMMs decoded 2.7x slower in both modes (787 against 2,105 tok/s), which dilutes
# the loss (0.20%): not a speed setting; the default's pairs (1.01 / 0.99%) and two more processes on the same
# machine (sessions_ab_10x50k_mtp0{_57a4fc8_b,_mtp3_57a4fc8}.json) gave 0.93% over 9 pairs.
# Done at ee2727c (the previous version of this script): 8 default pairs, the 50K throughput curve.
source experiments/results/probes/gpu_setup.sh
export JAX_PLATFORMS=cuda,cpu
AB="--config=configs/h200_bench.py --config.run.prompt_len=50000 --config.run.max_new_tokens=512 --sessions=10
  --pairs=2 --max_pairs=10 --mtp=0 --append=0 --workload=local99"
XLA_FLAGS="--xla_gpu_autotune_level=0" timeout 280 python -m experiments.sessions_ab $AB --budget_s=230 \
  --out=$OUT/sessions_ab_10x50k_mtp0_autotune0_$R.json 2>&1 | grep "^\[" | cut -c1-400 | tail -12
el sessions_ab autotune0
LEFT=$(( LIMIT - $(date +%s) + T0 - 40 ))
timeout $(( LEFT + 30 )) python -m experiments.sessions_ab $AB --budget_s=$LEFT \
  --out=$OUT/sessions_ab_10x50k_mtp0_$R.json 2>&1 | grep "^\[" | cut -c1-400 | tail -12
el sessions_ab default
