#!/usr/bin/env bash
# Does XLA's command-buffer update mode take the per-call CUDA-graph update off the host? The host profile of a
# batch-1 decode step (profile_decode_8k_host_e0171ab.json) spends 1.42 ms a call in command_buffer::update and
# 1.72 ms in cuGraphLaunch, of a ~3.4 ms step: the step's temporaries land at new addresses each call, so every graph
# node that reads them is patched before the launch. SKIP_TEMP gives referenced temporaries stable virtual
# addresses (VMM allocator). Same build, with and without the flag: batch-1 generate at 8K (tokens compared), then
# the 10 x 50K A/B at MTP 0 (one pair) without and with the flag, for the step-call p99 of issue 9.
# Run from the repository root with GLM53_GIT_REVISION=<commit> and OUT=<output folder>.
set -u
export JAX_PLATFORMS=cuda,cpu
T0=$(date +%s); el() { echo "[t=$(( $(date +%s) - T0 ))s] $*"; }
for whl in .whl/ml_collections-*.whl; do [ -e "$whl" ] && python -m pip install -q --no-deps "$whl"; done
python -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v "^WARNING: Running pip" | tail -2
ab() {  # the 10 x 50K A/B at MTP 0, one pair; $1: variant, $2: XLA_FLAGS
  LEFT=$(( LIMIT - $(date +%s) + T0 )); [ $LEFT -lt 60 ] && return
  XLA_FLAGS="$2" timeout $LEFT python -m experiments.sessions_ab --config=configs/h200_bench.py \
    --config.run.prompt_len=50000 --config.run.max_new_tokens=512 --sessions=10 --pairs=1 --max_pairs=1 --mtp=0 \
    --append=0 --workload=local99 --out=$OUT/sessions_ab_10x50k_$1_$GLM53_GIT_REVISION.json 2>&1 | grep "^\[" | tail -6
  el sessions_ab $1
}
# LIMIT (s, default 470): the call's time; AB_DEFAULT=1 runs the A/B with default flags first (the local99 override
# without its per-step host sync: the binary search's while loop, fixed at d23452f).
LIMIT=${LIMIT:-470}
[ -n "${AB_DEFAULT:-}" ] && ab default ""
FLAG=""
for mode in SKIP_TEMP NEVER_UPDATE; do  # the newer name, then the one jaxlib 0.10 knows (it remaps every referenced buffer)
  if XLA_FLAGS=--xla_gpu_command_buffer_update_mode=$mode timeout 60 python -c \
      "import jax, jax.numpy as jnp; print(float(jax.jit(lambda x: (x * 2).sum())(jnp.ones(8))))" >/tmp/flag_$mode.log 2>&1; then
    FLAG="--xla_gpu_command_buffer_update_mode=$mode"; echo "accepted: $mode"; break
  else
    echo "rejected: $mode: $(grep -i "error\|unknown\|fatal" /tmp/flag_$mode.log | head -2)"
  fi
done
el flags
if [ -z "$FLAG" ]; then ab default ""; exit 0; fi
echo "$FLAG" > $OUT/flag.txt
for variant in default flag; do
  F=""; [ $variant = flag ] && F="$FLAG"
  XLA_FLAGS="$F" timeout 90 python -m experiments.generate --config=configs/h200_bench.py \
    --config.run.prompt_len=8192 --config.run.max_new_tokens=${GEN_TOKENS:-512} \
    --config.run.output_json=$OUT/generate_8192_${GEN_TOKENS:-512}_${variant}_$GLM53_GIT_REVISION.json \
    2>&1 | grep "decode\|roofline\|host:\|rror" | tail -4
  el gen $variant
done
ab flag "$FLAG"
