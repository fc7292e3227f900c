#!/usr/bin/env bash
# H200 call of stop 44: the A/B's own runs under the command-buffer and allocator logs (cmdbuf_updates.py ab).
# At 297bef8 the 10 x 50K A/B still had its slowest calls at steps 1-3 of both modes (MTP 0) and 1-4 (resident
# MTP 3), though the probe's single-engine runs no longer recorded there (cmdbuf_updates_8k_series_8d78e85.json):
# which calls record, and what moved? 10 x 8K, 256 tokens, MTP 0 and 3, one pair.
LIMIT=${LIMIT:-400}
source experiments/results/probes/gpu_setup.sh
export JAX_PLATFORMS=cuda,cpu
P=experiments/results/probes
TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3,bfc_allocator=3 timeout $(( LIMIT - 40 )) \
  python $P/cmdbuf_updates.py ab --config=configs/h200_bench.py --config.run.prompt_len=8192 \
  --config.run.max_new_tokens=256 --sessions=10 --pairs=1 --max_pairs=1 --mtp=0,3 --append=0 --workload=local99 \
  --out=$OUT/sessions_ab_10x8k_cmdbuf_$R.json 2> $OUT/cmdbuf_log_ab8k.txt | grep "pair 0\]" | cut -c1-300
python $P/cmdbuf_updates.py parse $OUT/cmdbuf_log_ab8k.txt $OUT/cmdbuf_updates_ab8k_$R.json > /dev/null 2>&1
python - $OUT/cmdbuf_updates_ab8k_$R.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["results"] or []:
    print(r["run"], "mtp", r["mtp"], "recorded", r["recorded_steps"][:12], "p50", r["call_p50_ms"], "slowest", r["slowest"][:5])
print("compiles after the first runs", {k: len(v) for k, v in d["compiles_after_warmup"].items()})
print("evicted", d["evicted"])
PY
gzip -f $OUT/cmdbuf_log_ab8k.txt
el ab8k
