"""Where a batched decode step's time goes on the host: engine loop vs raw dispatch vs synced calls."""
import json, os, sys, time
import numpy as np, jax, jax.numpy as jnp
import glm53
import importlib
h200_bench = importlib.import_module(os.environ.get('CFG', 'configs.h200_bench'))
from experiments import workloads

OUT = os.environ.get("OUT", "/tmp")
c = h200_bench.get_config()
H = int(os.environ.get("H", 8192)); S = int(os.environ.get("S", 16)); NEW = 24
cc = glm53.CacheConfig.from_config_dict(c.cache).replace(mode=os.environ.get("MODE", "resident"), max_len=H + 16 + 4 * NEW + 8)
model = glm53.from_config(c.model, seed=0, dtype=c.dtype, cache_config=cc)
e = glm53.Engine(model, cc, max_sessions=S)
rng = np.random.default_rng(0)
root = e.open(rng.integers(0, model.config.vocab_size, H).tolist())
sids = [root] + [e.fork(root) for _ in range(S - 1)]
for i, s in enumerate(sids):
    e.append(s, rng.integers(0, model.config.vocab_size, 16).tolist())
K = e.topk
PAGES = glm53.offload.copy_pages_for(cc, 1) if cc.mode == "offload" else 0
res = {"H": H, "S": S, "mode": cc.mode}

def gen(sub, n, sel=True):
    ov = workloads.local99_sessions(K, H, 1, len(sub)) if sel else None
    t = time.perf_counter()
    out = e.generate({s: n for s in sub}, selection_override=ov)
    dt = time.perf_counter() - t
    r = e.last_run
    for s in sub:
        e.rollback(s, len(out[s]))
    return {"wall_s": dt, "decode_s": r.decode_s, "steps": r.steps, "ms_per_step": 1e3 * r.decode_s / max(r.steps, 1),
            "call_ms_p50": 1e3 * float(np.median(r.step_call_s)), "host_loop_s": r.host_loop_s, "compile_s": r.compile_s}

for sub_n in (1, S):
    sub = sids[:sub_n]
    gen(sub, 4); gen(sub, 4, sel=False)
    res[f"engine_local99_B{sub_n}"] = gen(sub, NEW)
    res[f"engine_indexer_B{sub_n}"] = gen(sub, NEW, sel=False)
    import cProfile, pstats, io
    pr = cProfile.Profile(); pr.enable(); gen(sub, NEW); pr.disable()
    sio = io.StringIO(); pstats.Stats(pr, stream=sio).sort_stats("tottime").print_stats(14); print(sio.getvalue()[-3500:])
    print(sub_n, res[f"engine_local99_B{sub_n}"], res[f"engine_indexer_B{sub_n}"], flush=True)
    # raw: the decode step called back to back with no host work between (indexer selection)
    step = e._step("decode")
    lanes, B = e._lanes([e._session(s).slot for s in sub])
    tokens = jnp.zeros((B,), jnp.int32); rem = jnp.full((B,), 1000, jnp.int32)
    stop = e._stop_ids(None)
    e.cache, (tokens, _, _) = step(model.params, e.cache, lanes, tokens, rem, jnp.int32(0), jnp.float32(0), jnp.float32(1), stop, None, greedy=True, kernels=e.kernels, copy_pages=PAGES)
    for mode in ("async", "sync"):
        ts = []
        t0 = time.perf_counter()
        for i in range(NEW):
            t = time.perf_counter()
            e.cache, (tokens, _, rem2) = step(model.params, e.cache, lanes, tokens, rem, jnp.int32(0), jnp.float32(0), jnp.float32(1), stop, None, greedy=True, kernels=e.kernels, copy_pages=PAGES)
            if mode == "sync":
                jax.block_until_ready(tokens)
            ts.append(time.perf_counter() - t)
        jax.block_until_ready(e.cache)
        tot = time.perf_counter() - t0
        res[f"raw_{mode}_B{sub_n}"] = {"ms_per_step": 1e3 * tot / NEW, "call_ms_p50": 1e3 * float(np.median(ts))}
        print(sub_n, mode, res[f"raw_{mode}_B{sub_n}"], flush=True)
        # the raw loop advanced the sessions' device lengths without the host table: undo by truncating
    break_after = True
    hlo = model.steps.lower("decode", model.params, e.cache, lanes, tokens, rem, jnp.int32(0), jnp.float32(0), jnp.float32(1), stop, None, greedy=True, kernels=e.kernels, copy_pages=PAGES).compile().as_text()
    res[f"hlo_B{sub_n}"] = {"command_buffer_mentions": hlo.count("command_buffer"), "len": len(hlo), "custom_calls": hlo.count("custom-call(")}
    print(sub_n, res[f"hlo_B{sub_n}"], flush=True)
    # the raw loop wrote rows past the host table: the engine is now inconsistent; rebuild for the next size
    if sub_n == 1:
        for s in list(sids):
            e.close(s)
        root = e.open(rng.integers(0, model.config.vocab_size, H).tolist())
        sids = [root] + [e.fork(root) for _ in range(S - 1)]
        for i, s in enumerate(sids):
            e.append(s, rng.integers(0, model.config.vocab_size, 16).tolist())
json.dump(res, open(f"{OUT}/hostgap_{cc.mode}_{S}.json", "w"), indent=1)
