"""copy_blocks (interpreted on CPU) == its pure-jnp reference == a numpy oracle, bit for bit; through ``ops`` with
either side in ``pinned_host`` memory, where the result stays."""

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernels_pallas import kv_formats as kvf
from kernels_pallas import ops

cb = importlib.import_module("kernels_pallas.copy_blocks")

# Interpreted on the CPU, compiled on a GPU: the same tests check the real kernels on the H200.
INTERPRET = jax.default_backend() not in ("gpu", "cuda", "rocm")

HOST = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")


def _planes(fmt, rows, seed):
    """Random planes ``{plane: [rows, W]}`` of ``fmt`` (numpy, no packing: a copy moves bytes, whatever they
    encode). No NaNs: XLA on the CPU may canonicalise their payloads, and the cache never holds any."""
    rng = np.random.default_rng(seed)
    out = {}
    for n, (shape, dtype) in kvf.get_format(fmt).plane_shapes(rows).items():
        if jnp.issubdtype(dtype, jnp.integer):
            out[n] = rng.integers(-128, 128, shape).astype(dtype)
        else:
            out[n] = (rng.normal(size=shape) * 2.0 ** rng.integers(-6, 6, (rows, 1))).astype(dtype)
    return out


def _blocks(seed, NB, block_size, R_src, R_dst):
    """Blocks with counts of every kind (<= 0, partial, full, past block_size), sources anywhere (overlapping is
    fine) and destinations in disjoint ranges of block_size rows."""
    rng = np.random.default_rng(seed)
    assert NB * block_size <= R_dst
    count = rng.integers(-2, block_size + 3, NB)
    count[:4] = [0, block_size, 1, block_size + 5][:NB]
    src_start = rng.integers(0, R_src - block_size + 1, NB)
    dst_start = rng.permutation(R_dst // block_size)[:NB] * block_size + rng.integers(0, 2, NB) * (block_size // 2)
    dst_start = np.minimum(dst_start, R_dst - block_size)
    # half-offset starts may make neighbours overlap: keep only blocks whose destinations are disjoint
    taken = np.zeros(R_dst, bool)
    for i in range(NB):
        span = slice(dst_start[i], dst_start[i] + max(0, min(count[i], block_size)))
        if taken[span].any():
            count[i] = 0
        taken[span] = True
    return [np.asarray(a, np.int32) for a in (src_start, dst_start, count)]


def _oracle(dst, src, src_start, dst_start, count, block_size):
    out = {n: v.copy() for n, v in dst.items()}
    for s, d, c in zip(src_start, dst_start, count):
        c = max(0, min(int(c), block_size))
        for n in out:
            out[n][d:d + c] = src[n][s:s + c]
    return out


def _assert_equal(got, want):
    for n in want:
        g = np.asarray(got[n])
        assert g.dtype == want[n].dtype and g.shape == want[n].shape
        # bytes, so that NaN payloads of fp8 / bf16 rows compare too
        np.testing.assert_array_equal(g.view(np.uint8), want[n].view(np.uint8), err_msg=n)


@pytest.mark.parametrize("fmt,block_size,block_rows", [("q8g64", 16, 4), ("fp8g128", 16, 16), ("bf16", 8, 4)])
def test_copy_blocks_matches_reference_and_oracle(fmt, block_size, block_rows):
    R_src, R_dst, NB = 96, 160, 9
    src, dst = _planes(fmt, R_src, 0), _planes(fmt, R_dst, 1)
    idx = _blocks(2, NB, block_size, R_src, R_dst)
    want = _oracle(dst, src, *idx, block_size)
    kw = dict(block_size=block_size, block_rows=block_rows)
    fresh = lambda: {n: jnp.asarray(v) for n, v in dst.items()}
    args = ({n: jnp.asarray(v) for n, v in src.items()}, *map(jnp.asarray, idx))
    _assert_equal(cb.copy_blocks(fresh(), *args, interpret=INTERPRET, **kw), want)
    _assert_equal(cb.copy_blocks_reference(fresh(), *args, **kw), want)
    assert (idx[2] <= 0).any() and ((idx[2] > 0) & (idx[2] < block_size)).any() and (idx[2] > block_size).any()


def _host(planes):
    return {n: jax.device_put(v, HOST) for n, v in planes.items()}


@pytest.mark.parametrize("impl", ["pallas", "reference"])
@pytest.mark.parametrize("side", ["dst", "src"])
def test_ops_copy_blocks_with_host_memory(impl, side):
    """ops.copy_blocks with dst (copyback: ring rows into the host pool) or src (bulk read: host pages into a device
    buffer) in pinned_host memory, called inside a jit that donates dst as the model's steps do: the result is the
    oracle's and lives where dst lived; rows outside the copied ranges keep their values."""
    fmt, block_size, R_src, R_dst, NB = "q8g64", 8, 64, 96, 7
    src, dst = _planes(fmt, R_src, 3), _planes(fmt, R_dst, 4)
    idx = _blocks(5, NB, block_size, R_src, R_dst)
    want = _oracle(dst, src, *idx, block_size)
    d = _host(dst) if side == "dst" else {n: jnp.asarray(v) for n, v in dst.items()}
    s = _host(src) if side == "src" else {n: jnp.asarray(v) for n, v in src.items()}
    step = jax.jit(functools.partial(ops.copy_blocks, block_size=block_size, impl=impl), donate_argnums=0)
    got = step(d, s, *map(jnp.asarray, idx))
    for n, v in got.items():
        assert v.sharding.memory_kind == ("pinned_host" if side == "dst" else "device"), n
    _assert_equal(got, want)
    untouched = np.ones(R_dst, bool)
    for start, c in zip(idx[1], idx[2]):
        untouched[start:start + max(0, min(c, block_size))] = False
    for n in dst:
        np.testing.assert_array_equal(np.asarray(got[n])[untouched].view(np.uint8), dst[n][untouched].view(np.uint8))


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**31 - 1), st.sampled_from([(4, 4), (8, 2), (16, 8)]), st.integers(1, 6),
       st.integers(0, 40))
def test_copy_blocks_random_sizes(seed, sizes, NB, extra_src):
    block_size, block_rows = sizes
    R_src, R_dst = block_size + extra_src, NB * block_size + 8
    src, dst = _planes("q8g64", R_src, seed % 1000), _planes("q8g64", R_dst, seed % 1000 + 1)
    idx = _blocks(seed, NB, block_size, R_src, R_dst)
    want = _oracle(dst, src, *idx, block_size)
    kw = dict(block_size=block_size, block_rows=block_rows)
    args = ({n: jnp.asarray(v) for n, v in src.items()}, *map(jnp.asarray, idx))
    _assert_equal(cb.copy_blocks({n: jnp.asarray(v) for n, v in dst.items()}, *args, interpret=INTERPRET, **kw), want)
    _assert_equal(cb.copy_blocks_reference({n: jnp.asarray(v) for n, v in dst.items()}, *args, **kw), want)


def test_copy_blocks_validation():
    p = {n: jnp.asarray(v) for n, v in _planes("q8g64", 16, 0).items()}
    i = jnp.zeros((2,), jnp.int32)
    with pytest.raises(ValueError, match="powers of two"):
        cb.copy_blocks_reference(p, p, i, i, i, block_size=12)
    with pytest.raises(ValueError, match="block_rows <= block_size"):
        cb.copy_blocks_reference(p, p, i, i, i, block_size=8, block_rows=16)
    with pytest.raises(ValueError, match="same planes"):
        cb.copy_blocks_reference(p, {"latent": p["latent"]}, i, i, i, block_size=8, block_rows=8)
    with pytest.raises(ValueError, match="width or dtype"):
        cb.copy_blocks_reference(p, {**p, "rope": p["rope"].astype(jnp.float32)}, i, i, i, block_size=8,
                                 block_rows=8)
    with pytest.raises(ValueError, match="int\\[NB\\]"):
        cb.copy_blocks_reference(p, p, i, i, jnp.zeros((3,), jnp.int32), block_size=8, block_rows=8)
    with pytest.raises(ValueError, match="impl"):
        ops.copy_blocks(p, p, i, i, i, block_size=8, impl="triton")


def test_resolve():
    on_gpu = jax.default_backend() in ops.GPU_BACKENDS
    assert ops.resolve("auto") == (on_gpu, False)
    assert ops.resolve("pallas") == (True, not on_gpu)
    assert ops.resolve("reference") == (False, False)
    with pytest.raises(ValueError, match="impl"):
        ops.resolve(None)
