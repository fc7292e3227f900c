import sys
import numpy as np, jax, jax.numpy as jnp
sys.path.insert(0, ".")
from instep_copyback import host_gather, copy_blocks, HS, DS, P, L, K, W, work
def build(rows_pool):
    pool = jax.device_put(np.zeros((rows_pool, W), np.int8), HS)
    ring = jax.device_put(np.zeros((P * L * 2, W), np.int8), DS)
    x = jax.device_put(jnp.ones((16, 8192), jnp.bfloat16), DS)
    idx = jax.device_put(np.arange(K, dtype=np.int32), DS)
    return pool, ring, x, idx
dst0 = jnp.arange(L, dtype=jnp.int32) * P
def a(state, idx, due, i):
    pool, ring, x = state
    rows = host_gather(idx, pool)
    return copy_blocks(pool, ring, dst0, dst0), ring, x + rows[:16, :1].astype(x.dtype)
def b(state, idx, due, i):
    pool, ring, x = state
    rows = host_gather(idx, pool)
    ring = jax.lax.dynamic_update_slice(ring, jnp.full((P * L, W), 3, jnp.int8), (0, 0))
    return copy_blocks(pool, ring, dst0, dst0), ring, x + rows[:16, :1].astype(x.dtype)
def d(state, idx, due, i):
    pool, ring, x = state
    rows = host_gather(idx, pool)
    x = work(x, rows)
    ring = jax.lax.dynamic_update_slice(ring, jnp.full((P * L, W), 3, jnp.int8), (0, 0))
    return copy_blocks(pool, ring, dst0, dst0), ring, x
def e(state, idx, due, i):
    pool, ring, x = state
    rows = host_gather(idx, pool)
    x = work(x, rows)
    ring = jax.lax.dynamic_update_slice(ring, jnp.full((P * L, W), (i % 100).astype(jnp.int8), jnp.int8), (0, 0))
    dst = jnp.where(due, (i // 16 * L + jnp.arange(L, dtype=jnp.int32)) * P, -1)
    return copy_blocks(pool, ring, dst.astype(jnp.int32), dst0), ring, x
def f_writefirst(state, idx, due, i):
    pool, ring, x = state
    dst = jnp.where(due, (i // 16 * L + jnp.arange(L, dtype=jnp.int32)) * P, -1)
    pool = copy_blocks(pool, ring, dst.astype(jnp.int32), dst0)
    rows = host_gather(idx, pool)
    x = work(x, rows)
    ring = jax.lax.dynamic_update_slice(ring, jnp.full((P * L, W), (i % 100).astype(jnp.int8), jnp.int8), (0, 0))
    return pool, ring, x
for rows_pool in (1 << 16, 1 << 20):
    args = build(rows_pool)
    for name, fn in (("a tuple", a), ("b +ringDUS", b), ("d +work", d), ("e +dyn dst", e), ("f write first", f_writefirst)):
        try:
            j = jax.jit(fn, donate_argnums=(0,), out_shardings=(HS, DS, DS))
            hlo = j.lower(args[:3], args[3], jnp.bool_(True), jnp.int32(0)).compile().as_text()
            copies = [l.strip()[:70] for l in hlo.splitlines() if " copy(" in l or "copy-start" in l]
            print(f"pool {rows_pool} {name}: {len(copies)} copies {copies[:2]}")
        except Exception as ex:
            print(f"pool {rows_pool} {name}: FAILED {type(ex).__name__}: {str(ex)[:200]}")
