"""Probe: copyback inside the decode step (a Pallas kernel writing ring rows into the pinned_host pool, aliased,
donated, data-dependent skip) vs a separate copyback call vs no copyback. Host call times and wall time."""
import functools, time, json, sys
import numpy as np, jax, jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

dev = jax.devices()[0]
HS = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
DS = jax.sharding.SingleDeviceSharding(dev)
ROWS, W, P, L = 1 << 20, 512, 64, 9
RING = 256
K = 2048
STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 256
BR = 16

def gather_kernel(idx_ref, src_ref, out_ref):
    i = pl.program_id(0)
    out_ref[...] = src_ref[idx_ref[pl.ds(i * BR, BR)], :]

def host_gather(idx, pool):
    return pl.pallas_call(gather_kernel, out_shape=jax.ShapeDtypeStruct((K, W), pool.dtype), grid=(K // BR,),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)] * 2, out_specs=pl.BlockSpec((BR, W), lambda i: (i, 0)),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1))(idx, pool)

def copy_kernel(dst_start_ref, src_start_ref, src_ref, dst_in, dst_ref):
    b, j = pl.program_id(0), pl.program_id(1)
    d = dst_start_ref[b]
    @pl.when(d >= 0)
    def _():
        s = src_start_ref[b]
        r = j * BR + jnp.arange(BR, dtype=jnp.int32)
        cols = jnp.arange(W, dtype=jnp.int32)[None, :]
        v = plgpu.load(src_ref.at[(s + r)[:, None], cols])
        plgpu.store(dst_ref.at[(d + r)[:, None], cols], v)

def copy_blocks(pool, ring, dst_start, src_start):
    nb = dst_start.shape[0]
    return pl.pallas_call(copy_kernel, out_shape=jax.ShapeDtypeStruct(pool.shape, pool.dtype), grid=(nb, P // BR),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)] * 4, out_specs=pl.BlockSpec(memory_space=pl.ANY),
        input_output_aliases={3: 0}, compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1))(
            dst_start, src_start, ring, pool)

w_big = jax.device_put(jax.random.normal(jax.random.key(0), (8192, 8192), jnp.bfloat16), DS)

def work(x, rows):
    # ~1-2 ms of device work standing in for a decode step
    y = x
    for _ in range(60):
        y = jnp.tanh(y @ w_big)
    return y + rows[:, :1].astype(y.dtype).sum()

VARIANT = "writefirst"
def step_instep(state, idx, page_due, step_i):
    pool, ring, x = state
    dst = jnp.where(page_due, (step_i // 16 * L + jnp.arange(L, dtype=jnp.int32)) * P, -1)
    src = jnp.arange(L, dtype=jnp.int32) * P
    pool = copy_blocks(pool, ring, dst.astype(jnp.int32), src)
    rows = host_gather(idx, pool)
    x = work(x, rows)
    new = jnp.full((P * L, W), (step_i % 100).astype(jnp.int8), jnp.int8)
    ring = jax.lax.dynamic_update_slice(ring, new, (0, 0))
    return (pool, ring, x)

def step_plain(state, idx):
    pool, ring, x = state
    rows = host_gather(idx, pool)
    x = work(x, rows)
    return (ring, x)

def copyback_xla(pool, ring, page):
    rows = jax.lax.dynamic_slice(ring, (0, 0), (P * L, W))
    return jax.lax.dynamic_update_slice(pool, jax.device_put(rows, jax.memory.Space.Host), (page * P * L, 0))

def hlo_copies(variant, pool, ring, x, idx):
    global VARIANT
    VARIANT = variant
    f = jax.jit(step_instep, donate_argnums=(0,), out_shardings=((HS, DS, DS)))
    hlo = f.lower((pool, ring, x), idx, jnp.bool_(True), jnp.int32(0)).compile().as_text()
    return [l.strip()[:140] for l in hlo.splitlines() if " copy(" in l or "copy-start" in l]

def main():
    out = {}
    pool = jax.device_put(np.zeros((ROWS, W), np.int8), HS)
    ring = jax.device_put(np.zeros((P * L * 2, W), np.int8), DS)
    x = jax.device_put(jnp.ones((16, 8192), jnp.bfloat16), DS)
    idx = jax.device_put(np.sort(np.random.default_rng(0).choice(ROWS // 2, K, replace=False)).astype(np.int32), DS)
    global VARIANT
    VARIANT = sys.argv[2] if len(sys.argv) > 2 else "dep"
    f_in = jax.jit(step_instep, donate_argnums=(0,), out_shardings=((HS, DS, DS)))
    hlo = f_in.lower((pool, ring, x), idx, jnp.bool_(True), jnp.int32(0)).compile().as_text()
    copies = [l.strip()[:160] for l in hlo.splitlines() if " copy(" in l or "copy-start" in l]
    out["instep_hlo_copies"] = copies[:10]
    print("in-step HLO copies:", copies[:10])
    st = (pool, ring, x)
    times = []
    for i in range(STEPS + 8):
        t = time.perf_counter()
        st = f_in(st, idx, jnp.bool_(i % 16 == 0), jnp.int32(i))
        times.append(time.perf_counter() - t)
        if i == 7:
            jax.block_until_ready(st); t0 = time.perf_counter()
    jax.block_until_ready(st); wall = time.perf_counter() - t0
    a = np.asarray(st[0][: 16 * P * L * 2])
    ok = bool((a[: P * L] == 0).all() and (a[P * L: P * L * 2] == 15).all())
    ct = np.array(times[8:]) * 1e3
    due = np.array([(i % 16 == 0) for i in range(8, STEPS + 8)])
    out["instep"] = dict(wall_ms_per_step=wall / STEPS * 1e3, call_median=float(np.median(ct)), call_p99=float(np.percentile(ct, 99)),
                         call_due_median=float(np.median(ct[due])), call_other_median=float(np.median(ct[~due])), content_ok=ok,
                         pool_kind=st[0].sharding.memory_kind)
    print("instep", out["instep"])
    pool, ring, x = st
    try:
        print("pool type after in-step loop:", jax.typeof(pool), pool.sharding)
    except Exception as e:
        print("typeof failed", e)
    pool = jax.device_put(np.asarray(pool), HS)
    print("pool type after fresh device_put:", jax.typeof(pool))
    f_cb = jax.jit(copyback_xla, donate_argnames=("pool",))
    # plain and separate copyback loops
    g = jax.jit(lambda s, idx, pool: step_plain((pool, s[0], s[1]), idx), donate_argnums=(0,))
    for mode in ("plain", "separate_copyback"):
        s = (jnp.array(ring), jnp.array(x))
        times = []
        for i in range(STEPS + 8):
            t = time.perf_counter()
            s = g(s, idx, pool)
            if mode == "separate_copyback" and i % 16 == 0:
                pool = f_cb(pool, s[0], jnp.int32(i // 16 + 20))
            times.append(time.perf_counter() - t)
            if i == 7:
                jax.block_until_ready(s); t0 = time.perf_counter()
        jax.block_until_ready((s, pool)); wall = time.perf_counter() - t0
        ct = np.array(times[8:]) * 1e3
        out[mode] = dict(wall_ms_per_step=wall / STEPS * 1e3, call_median=float(np.median(ct)), call_p99=float(np.percentile(ct, 99)),
                         call_due_median=float(np.median(ct[due])), call_other_median=float(np.median(ct[~due])))
        print(mode, out[mode])
    print(json.dumps(out))

if __name__ == '__main__':
    main()
