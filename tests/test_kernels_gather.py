"""Pallas gather_rows (interpreted on CPU) == the pure-jnp reference, bit for bit, for any lane -> plane map."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import kv_formats as kvf
from kernels_pallas import gather_rows, gather_rows_reference

# Interpreted on the CPU, compiled on a GPU: the same tests check the real kernels on the H200.
INTERPRET = jax.default_backend() not in ("gpu", "cuda", "rocm")
FORMATS = list(kvf.KV_FORMATS)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4))
def _planes(name, S, N, seed=0, model_dtype=jnp.float32):
    k1, k2 = jax.random.split(jax.random.key(seed))
    # Rows of very different magnitudes so every group gets its own scale.
    mag = 2.0 ** jax.random.randint(k1, (S, N, 1), -12, 12).astype(jnp.float32)
    latent = (jax.random.normal(k1, (S, N, 512)) * mag).astype(model_dtype)
    rope = jax.random.normal(k2, (S, N, 64)).astype(model_dtype)
    latent = latent.at[:, 0, :64].set(0)  # an all-zero group at position 0
    return kvf.pack(name, latent, rope)


def _check(planes, plane_of_lane, positions, name, out_dtype, block_rows):
    plane_of_lane = jnp.asarray(plane_of_lane, jnp.int32)
    got = gather_rows(
        planes, plane_of_lane, positions, kv_format=name, out_dtype=out_dtype, block_rows=block_rows,
        interpret=INTERPRET,
    )
    want = gather_rows_reference(planes, plane_of_lane, positions, kv_format=name, out_dtype=out_dtype,
                                 block_rows=block_rows)
    S, M = positions.shape
    for g, w, width in zip(got, want, (512, 64)):
        assert g.shape == (S, M, width) and g.dtype == jnp.dtype(out_dtype)
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    return got


# bf16 outputs of every format are covered by test_gather_single_block.
@pytest.mark.parametrize("name", FORMATS)
def test_gather_matches_reference(name, out_dtype=jnp.float32):
    """3 planes (e.g. slots), 3 lanes reading planes [2, 0, 2]: lanes need not be planes, and may share one."""
    P, S, N, M = 3, 3, 64, 32
    planes = _planes(name, P, N)
    pos = jax.random.randint(jax.random.key(1), (S, M), 0, N)
    # Edges: first and last row, and repeated positions.
    pos = pos.at[0, 0].set(0).at[0, 1].set(N - 1).at[1, 5:9].set(7).at[1, -1].set(N - 1)
    got = _check(planes, [2, 0, 2], pos, name, out_dtype, block_rows=8)
    # The gathered rows are the stored rows of each lane's plane.
    lat, rope = kvf.unpack(name, planes, out_dtype)
    np.testing.assert_array_equal(np.asarray(got[0][1, 5]), np.asarray(lat[0, 7]))
    np.testing.assert_array_equal(np.asarray(got[1][0, 1]), np.asarray(rope[2, N - 1]))
    np.testing.assert_array_equal(np.asarray(got[0][2]), np.asarray(lat[2, np.asarray(pos[2])]))


@pytest.mark.parametrize("name", FORMATS)
def test_gather_single_block(name):
    """M == block_rows, one lane reading the last plane, positions reversed and at both ends."""
    N = 16
    planes = _planes(name, 2, N, seed=3, model_dtype=jnp.bfloat16)
    pos = jnp.arange(N - 1, -1, -1, dtype=jnp.int32)[None]
    _check(planes, [1], pos, name, jnp.bfloat16, block_rows=16)


def test_gather_validation():
    planes = _planes("q8g64", 1, 16)
    pos = jnp.zeros((1, 24), jnp.int32)
    lane = jnp.zeros((1,), jnp.int32)
    with pytest.raises(ValueError, match="multiple of block_rows"):
        gather_rows(planes, lane, pos, kv_format="q8g64", block_rows=16, interpret=INTERPRET)
    with pytest.raises(ValueError, match="power of two"):
        gather_rows(planes, lane, pos, kv_format="q8g64", block_rows=12, interpret=INTERPRET)
    with pytest.raises(ValueError, match="needs planes"):
        gather_rows(
            {"latent": planes["latent"], "rope": planes["rope"]},
            lane,
            pos,
            kv_format="q8g64",
            block_rows=8,
            interpret=INTERPRET,
        )
    with pytest.raises(ValueError, match="plane 'latent'"):
        gather_rows(
            dict(planes, latent=planes["latent"].astype(jnp.float32)),
            lane,
            pos,
            kv_format="q8g64",
            block_rows=8,
            interpret=INTERPRET,
        )
    with pytest.raises(ValueError, match="Unknown KV format"):
        gather_rows(planes, lane, pos, kv_format="q4", block_rows=8, interpret=INTERPRET)
    for bad in (jnp.zeros((2,), jnp.int32), jnp.zeros((1,), jnp.float32)):
        with pytest.raises(ValueError, match="plane_of_lane"):
            gather_rows_reference(planes, bad, pos, kv_format="q8g64", block_rows=8)


def test_gather_reads_stacked_planes_in_place():
    """Lanes read any planes of stacked [L * S, N, W] planes (e.g. layer 1 of slots [2, 0]): the same rows as taking
    those planes out first."""
    name = "q8g64"
    L, S = 2, 3
    planes = _planes(name, L * S, 32, seed=5)
    pos = jax.random.randint(jax.random.key(2), (2, 16), 0, 32)
    plane_of_lane = jnp.asarray([1 * S + 2, 1 * S + 0], jnp.int32)
    taken = {k: v[np.asarray(plane_of_lane)] for k, v in planes.items()}
    want = gather_rows_reference(taken, jnp.arange(2, dtype=jnp.int32), pos, kv_format=name, out_dtype=jnp.float32)
    for fn, kw in ((gather_rows, {"interpret": INTERPRET}), (gather_rows_reference, {})):
        got = fn(planes, plane_of_lane, pos, kv_format=name, out_dtype=jnp.float32, block_rows=8, **kw)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_ops_gather_rows_pads_and_reads_host_planes():
    """ops.gather_rows: M not a multiple of the kernel's block (padded, sliced off), planes in pinned_host memory
    (the interpreter and the reference get device copies); kernel and reference agree."""
    from kernels_pallas import ops

    name = "q8g64"
    host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    planes = {k: jax.device_put(v, host) for k, v in _planes(name, 3, 32, seed=6).items()}
    pos = jax.random.randint(jax.random.key(3), (2, 20), 0, 32)
    plane_of_lane = jnp.asarray([2, 1], jnp.int32)
    step = jax.jit(ops.gather_rows, static_argnames=("kv_format", "out_dtype", "impl"))
    got = step(planes, plane_of_lane, pos, kv_format=name, out_dtype=jnp.float32, impl="pallas")
    want = step(planes, plane_of_lane, pos, kv_format=name, out_dtype=jnp.float32, impl="reference")
    for g, w in zip(got, want):
        assert g.shape[:2] == (2, 20)
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_gather_no_rows_and_integer_positions():
    """S or M = 0 gives empty outputs from the kernel as from the reference (a grid of zero programs failed in the
    interpreter with a slice error); float positions are refused rather than truncated."""
    planes = _planes("q8g64", 2, 16)
    for S, M in ((1, 0), (0, 16)):
        for fn, kw in ((gather_rows, {"interpret": INTERPRET}), (gather_rows_reference, {})):
            latent, rope = fn(planes, jnp.zeros((S,), jnp.int32), jnp.zeros((S, M), jnp.int32), kv_format="q8g64",
                              out_dtype=jnp.float32, block_rows=16, **kw)
            assert latent.shape == (S, M, 512) and rope.shape == (S, M, 64) and latent.dtype == jnp.float32
    with pytest.raises(ValueError, match="positions must be int"):
        gather_rows(planes, jnp.zeros((1,), jnp.int32), jnp.zeros((1, 16), jnp.float32), kv_format="q8g64",
                    block_rows=16, interpret=INTERPRET)
