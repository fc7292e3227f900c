#!/usr/bin/env bash
# The next H200 call for the decode-launch candidates (run from the repository root on the GPU machine, with
# GLM53_GIT_REVISION=<commit> and OUT=<output folder>):
#   1. the compiled kernel tests of the top-k (both block_totals) and the grouped matmuls / SwiGLU;
#   2. the engine and offload tests compiled with the one-launch SwiGLU (the model's path since f2a1453);
#   3. batch-1 generate at 8K with the top-k's default flipped to "atomic" in a copy of the tree, against the tree
#      as it is, in one call (tokens must be identical: both select the same positions).
# The GPU machine has no network and no ml_collections: carry its wheel in .whl/ (`pip download --no-deps
# ml_collections==1.1.0`). Use `python -m pip`: the machine's bare `pip` installs for another interpreter.
set -u
export JAX_PLATFORMS=cuda,cpu
for whl in .whl/ml_collections-*.whl; do [ -e "$whl" ] && python -m pip install -q --no-deps "$whl"; done
python -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v "^WARNING: Running pip" | tail -2
python -m pytest -q -p no:xdist tests/test_kernels_indexer.py tests/test_kernels_moe.py -k "topk or swiglu or grouped" \
  2>&1 | tail -4 | tee $OUT/tests_kernels_$GLM53_GIT_REVISION.txt
python -m pytest -q -n 4 tests/test_offload_model.py tests/test_engine.py 2>&1 | tail -6 \
  | tee $OUT/tests_model_$GLM53_GIT_REVISION.txt
rm -rf /tmp/atomic && mkdir /tmp/atomic && cp -r . /tmp/atomic/
sed -i 's/^    block_totals: str = "xla",$/    block_totals: str = "atomic",/' /tmp/atomic/kernels_pallas/indexer_topk.py
grep -q 'block_totals: str = "atomic",' /tmp/atomic/kernels_pallas/indexer_topk.py || { echo "default line moved"; exit 1; }
for i in 1 2; do
  for run in xla atomic; do
    dir=$([ $run = xla ] && echo . || echo /tmp/atomic)
    (cd $dir && python -m experiments.generate --config=configs/h200_bench.py --config.run.prompt_len=8192 \
      --config.run.max_new_tokens=256 --config.run.output_json=$OUT/generate_8k_topk_${run}_${i}_$GLM53_GIT_REVISION.json \
      2>&1 | grep "decode\|roofline" | tail -2)
  done
done
