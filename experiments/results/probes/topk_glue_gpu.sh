#!/usr/bin/env bash
# H200 call for the top-k's leaner glue (GLM53_GIT_REVISION=<new commit>, OLD_REV=<commit in .probe/old>, OUT set;
# carry .whl and .probe, with .probe/old = `git archive $OLD_REV` minus notebooks/ and experiments/results/):
#   1. the indexer kernels' tests compiled (JAX_PLATFORMS=cuda);
#   2. the batch-1 8K decode step profiled by kernel, old tree then new (device busy time a step: the host's
#      jitter does not enter it), the new one with XLA's HLO dump of jit_decode, summarised by cmdbuf_split.py;
#   3. batch-1 8K decode, 512 tokens, old then new, while time is left.
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s); el() { echo "[t=$(( $(date +%s) - T0 ))s] $*"; }
LIMIT=${LIMIT:-540}
NEW=$PWD; OLD=$PWD/.probe/old; R=$GLM53_GIT_REVISION
for whl in .whl/ml_collections-*.whl; do [ -e "$whl" ] && python -m pip install -q --no-deps "$whl"; done
python -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v "^WARNING: Running pip" | tail -2
el installed
JAX_PLATFORMS=cuda timeout 170 python -m pytest -q -p no:cacheprovider tests/test_kernels_indexer.py 2>&1 | tail -4
el kernel tests
export JAX_PLATFORMS=cuda,cpu
PROF="-m experiments.profile_decode --config=configs/h200_bench.py --config.run.prompt_len=8192 --config.run.max_new_tokens=32 --workload=indexer --modes=resident"
(cd $OLD && PYTHONPATH=$OLD GLM53_GIT_REVISION=$OLD_REV timeout 150 python $PROF --out=$OUT/profile_decode_8k_model_$OLD_REV.json 2>&1 | grep -i "busy\|error" | tail -3)
el profile old
XLA_FLAGS="--xla_dump_to=/tmp/dump --xla_dump_hlo_as_text --xla_dump_hlo_module_re=jit_decode" timeout 150 python $PROF \
  --out=$OUT/profile_decode_8k_model_$R.json 2>&1 | grep -i "busy\|error" | tail -3
python experiments/results/probes/cmdbuf_split.py /tmp/dump $OUT/cmdbuf_split_$R.json 2>&1 | tail -2
el profile new
for side in old new; do
  LEFT=$(( LIMIT - $(date +%s) + T0 )); [ $LEFT -lt 70 ] && break
  if [ $side = old ]; then D=$OLD; RR=$OLD_REV; else D=$NEW; RR=$R; fi
  (cd $D && PYTHONPATH=$D GLM53_GIT_REVISION=$RR timeout $LEFT python -m experiments.generate --config=configs/h200_bench.py \
    --config.run.prompt_len=8192 --config.run.max_new_tokens=512 --config.run.output_json=$OUT/generate_8k_512_$RR.json 2>&1 \
    | grep "decode\|roofline" | grep -v "it/s\]" | tail -2)
  el generate $side
done
