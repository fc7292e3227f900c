"""Pallas gather_rows (interpreted on CPU) == the pure-jnp reference, bit for bit."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import kv_formats as kvf
from kernels_pallas import gather_rows, gather_rows_reference

INTERPRET = True
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


def _check(planes, positions, name, out_dtype, block_rows):
    got = gather_rows(
        planes, positions, kv_format=name, out_dtype=out_dtype, block_rows=block_rows, interpret=INTERPRET
    )
    want = gather_rows_reference(planes, positions, kv_format=name, out_dtype=out_dtype, block_rows=block_rows)
    S, M = positions.shape
    for g, w, width in zip(got, want, (512, 64)):
        assert g.shape == (S, M, width) and g.dtype == jnp.dtype(out_dtype)
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    return got


# bf16 outputs of every format are covered by test_gather_single_block.
@pytest.mark.parametrize("name", FORMATS)
def test_gather_matches_reference(name, out_dtype=jnp.float32):
    S, N, M = 2, 64, 32
    planes = _planes(name, S, N)
    pos = jax.random.randint(jax.random.key(1), (S, M), 0, N)
    # Edges: first and last row, and repeated positions.
    pos = pos.at[0, 0].set(0).at[0, 1].set(N - 1).at[1, 5:9].set(7).at[1, -1].set(N - 1)
    got = _check(planes, pos, name, out_dtype, block_rows=8)
    # The gathered rows are the rows that were stored.
    lat, rope = kvf.unpack(name, planes, out_dtype)
    np.testing.assert_array_equal(np.asarray(got[0][1, 5]), np.asarray(lat[1, 7]))
    np.testing.assert_array_equal(np.asarray(got[1][0, 1]), np.asarray(rope[0, N - 1]))


@pytest.mark.parametrize("name", FORMATS)
def test_gather_single_block(name):
    """M == block_rows, one session, positions reversed and at both ends."""
    N = 16
    planes = _planes(name, 1, N, seed=3, model_dtype=jnp.bfloat16)
    pos = jnp.arange(N - 1, -1, -1, dtype=jnp.int32)[None]
    _check(planes, pos, name, jnp.bfloat16, block_rows=16)


def test_gather_validation():
    planes = _planes("q8g64", 1, 16)
    pos = jnp.zeros((1, 24), jnp.int32)
    with pytest.raises(ValueError, match="multiple of block_rows"):
        gather_rows(planes, pos, kv_format="q8g64", block_rows=16, interpret=INTERPRET)
    with pytest.raises(ValueError, match="power of two"):
        gather_rows(planes, pos, kv_format="q8g64", block_rows=12, interpret=INTERPRET)
    with pytest.raises(ValueError, match="needs planes"):
        gather_rows(
            {"latent": planes["latent"], "rope": planes["rope"]},
            pos,
            kv_format="q8g64",
            block_rows=8,
            interpret=INTERPRET,
        )
    with pytest.raises(ValueError, match="plane 'latent'"):
        gather_rows(
            dict(planes, latent=planes["latent"].astype(jnp.float32)),
            pos,
            kv_format="q8g64",
            block_rows=8,
            interpret=INTERPRET,
        )
    with pytest.raises(ValueError, match="Unknown KV format"):
        gather_rows(planes, pos, kv_format="q4", block_rows=8, interpret=INTERPRET)


def test_gather_from_stacked_planes_with_an_offset():
    """first_plane reads sessions [first_plane, first_plane + S) of stacked planes in place: the same rows as
    slicing those planes out first."""
    name = "q8g64"
    planes = _planes(name, 6, 32, seed=5)  # e.g. 3 layers x 2 sessions, flattened
    pos = jax.random.randint(jax.random.key(2), (2, 16), 0, 32)
    sliced = {k: v[2:4] for k, v in planes.items()}
    want = gather_rows_reference(sliced, pos, kv_format=name, out_dtype=jnp.float32)
    for fn, kw in ((gather_rows, {"interpret": INTERPRET}), (gather_rows_reference, {})):
        got = fn(planes, pos, kv_format=name, out_dtype=jnp.float32, block_rows=8, first_plane=2, **kw)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    with pytest.raises(ValueError, match="outside the planes"):
        gather_rows(planes, pos, kv_format=name, block_rows=8, first_plane=5, interpret=INTERPRET)
