# same-session A/B of the 8K batch-1 decode: 62932c1 (before the pipeline refactor) against fa830ed, alternating
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export XLA_FLAGS="" PYTHONUNBUFFERED=1 JAX_COMPILATION_CACHE_DIR=/tmp/jaxcc JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false
NEW=$PWD; OLD=$PWD/.probe/old
T0=$(date +%s); el() { echo "[t=$(( $(date +%s) - T0 ))s] $*"; }
for i in 0 1; do
 for side in old new; do
  if [ $side = old ]; then D=$OLD; R=62932c1; else D=$NEW; R=fa830ed; fi
  el $side $i; (cd $D && PYTHONPATH=/tmp/site:$D GLM53_GIT_REVISION=$R timeout 150 python3 -m experiments.generate --config=configs/h200_bench.py --config.run.prompt_len=8192 --config.run.max_new_tokens=256 --expert_weights=model --config.run.output_json=$OUT/gen8k_${side}_$i.json 2>&1 | grep "roofline\|tok/s" | tail -2)
 done
done
el done
