"""Probe: device time by kernel of MTP-3 forced verify steps, resident vs offload, 10 x 50K, local99."""
import collections
import json
import os
import tempfile
import time

import jax
import numpy as np

import glm53
from experiments import sessions_ab, workloads
from experiments.trace_util import device_events, find_xplane, trace_options
import importlib

S = int(os.environ.get("PROBE_SESSIONS", "10"))
HIST = int(os.environ.get("PROBE_HISTORY", "50000"))
NEW = int(os.environ.get("PROBE_NEW", "128"))
D = 3
c = importlib.import_module('configs.' + os.environ.get('PROBE_CONFIG', 'h200_bench')).get_config()
c.run.prompt_len = HIST
res = {}
for mode in ("resident", "offload"):
    c.cache.mode = mode
    cc = glm53.CacheConfig.from_config_dict(c.cache)
    if mode == "resident":
        model = glm53.from_config(c.model, seed=c.seed, dtype=c.dtype, cache_config=cc)
    max_len = HIST + 16 + NEW + 64
    cc = cc.replace(max_len=max_len)
    K = min(model.config.index_topk, max_len)
    e, sids, _ = sessions_ab.build(model, cc, c, S, suffix=16)  # one prefill, forks with their own pages

    def go(seed):
        out = e.generate({s: NEW for s in sids}, mtp=D, accept_override=D,
                         selection_override=workloads.selection("local99", K, HIST, seed, S))
        r = e.last_run
        for s in sids:
            e.rollback(s, len(out[s]))
        return r, out

    go(1), go(2)
    r, out = go(3)
    print(mode, "tok/s", r.decode_tokens / r.decode_s, "steps", r.steps, flush=True)
    logdir = tempfile.mkdtemp()
    with jax.profiler.trace(logdir, profiler_options=trace_options()):
        r, out = go(4)
    ev = device_events(find_xplane(logdir))
    per = collections.defaultdict(float)
    cnt = collections.Counter()
    for name, start, dur, stats in ev:
        import re
        key = re.sub(r"[._]?\d+$", "", name)[:60]
        per[key] += dur / 1e3
        cnt[key] += 1
    steps = r.steps + 1  # verify steps + the draft step
    busy = sum(per.values()) / steps
    top = sorted(per.items(), key=lambda kv: -kv[1])[:60]
    res[mode] = {"tok_s": r.decode_tokens / r.decode_s, "steps": steps, "busy_us_per_step": busy,
                 "kernels_us_per_step": {k: (round(v / steps, 2), round(cnt[k] / steps, 2)) for k, v in top},
                 "tokens": {int(s): out[s][:8] for s in sids[:2]}}
    print(mode, "busy us/step", busy, flush=True)
    del e
diff = {}
ko, kr = res["offload"]["kernels_us_per_step"], res["resident"]["kernels_us_per_step"]
for k in set(ko) | set(kr):
    diff[k] = round(ko.get(k, (0, 0))[0] - kr.get(k, (0, 0))[0], 2)
res["offload_minus_resident"] = dict(sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:40])
res["busy_diff_us"] = res["offload"]["busy_us_per_step"] - res["resident"]["busy_us_per_step"]
print(json.dumps({"busy_diff_us": res["busy_diff_us"], "diff": res["offload_minus_resident"]}, indent=0))
with open(os.path.join(os.environ.get("OUT", "/tmp"), "mtp_profile.json"), "w") as f:
    json.dump(res, f, indent=1)
