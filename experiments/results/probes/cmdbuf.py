"""Are the decode step's kernels in command buffers (CUDA graphs)? ms/step of the engine's decode, B=1 and B=8."""
import glob, json, os, sys, time
import numpy as np, jax
import glm53
from configs import h200_bench
c = h200_bench.get_config()
c.model.num_hidden_layers = 2
c.model.indexer_types = ("full", "shared")
kern = os.environ.get("KERN", "auto")
cc = glm53.CacheConfig.from_config_dict(c.cache).replace(mode=os.environ.get("MODE", "resident"), max_len=4096)
model = glm53.from_config(c.model, seed=0, dtype=c.dtype, cache_config=cc)
e = glm53.Engine(model, cc, max_sessions=8, kernels=kern)
rng = np.random.default_rng(0)
sids = [e.open(rng.integers(0, 1000, 2048).tolist())]
sids += [e.fork(sids[0]) for _ in range(7)]
out = {"tag": os.environ.get("TAG"), "kernels": e.kernels}
for B in (1, 8):
    sub = sids[:B]
    e.generate({s: 4 for s in sub})
    best = None
    for _ in range(3):
        o = e.generate({s: 32 for s in sub}); r = e.last_run
        ms = 1e3 * r.decode_s / r.steps
        best = ms if best is None else min(best, ms)
        call = 1e3 * float(np.median(r.step_call_s))
        for s in sub: e.rollback(s, len(o[s]))
    out[f"B{B}_ms_per_step"] = best; out[f"B{B}_call_ms"] = call
d = os.environ.get("DUMP")
if d:
    files = glob.glob(d + "/*decode*")
    n = 0
    for f in files:
        try:
            n += open(f, errors="ignore").read().count("command_buffer")
        except Exception:
            pass
    out["dump_files"] = len(files); out["command_buffer_in_decode_dump"] = n
    out["some_files"] = sorted(os.path.basename(f) for f in files)[:12]
print(json.dumps(out), flush=True)
