"""The sparse MLA decode-attention kernel (``kernels_pallas.mla_decode``, interpreted on the CPU) against its jnp
reference, which is the model's einsum attention."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

mla = importlib.import_module("kernels_pallas.mla_decode")
INTERPRET = jax.default_backend() not in ("gpu", "cuda", "rocm")


def _case(seed, Q=3, h=16, C=64, R=16, K=128, dtype=jnp.float32, attend_fraction=0.7):
    rng = np.random.default_rng(seed)
    q_lat, q_rope = rng.normal(size=(Q, h, C)), rng.normal(size=(Q, h, R))
    lat, rope = rng.normal(size=(Q, K, C)), rng.normal(size=(Q, K, R))
    attend = rng.random((Q, K)) < attend_fraction
    attend[:, 0] = True  # every row attends to something (a row with nothing is its own test)
    return tuple(jnp.asarray(x, dtype) for x in (q_lat, q_rope, lat, rope)) + (jnp.asarray(attend),)


@pytest.mark.parametrize("dtype,splits,head_block,column_parts,tol", [
    (jnp.float32, 1, None, 2, 1e-5), (jnp.float32, 4, None, 2, 1e-5), (jnp.float32, 2, 16, 1, 1e-5),
    (jnp.float32, 2, 16, 4, 1e-5), (jnp.bfloat16, 2, None, 2, 3e-2), (jnp.bfloat16, None, 16, 2, 3e-2)])
def test_mla_decode_matches_reference(dtype, splits, head_block, column_parts, tol):
    """Splits of the rows, blocks of heads, slices of the columns and the online softmax give the reference's
    result: to f32 rounding in f32, to the rounding of bf16 probabilities in bf16 (the kernel rounds them before
    normalising)."""
    args = _case(0, h=32, dtype=dtype)
    kw = dict(softmax_scale=0.125, splits=splits, block_rows=16, head_block=head_block, column_parts=column_parts)
    got = mla.mla_decode(*args, interpret=INTERPRET, **kw)
    want = mla.mla_decode_reference(*args, **kw)
    assert got.dtype == want.dtype == dtype and got.shape == want.shape == (3, 32, 64)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)


def test_mla_decode_masks_and_an_empty_row():
    """Rows not attended to count for nothing, even when their scores would dominate (a split entirely masked
    included); a query row attending to nothing is NaN in both."""
    q_lat, q_rope, lat, rope, attend = _case(1, attend_fraction=0.5)
    attend = np.asarray(attend).copy()
    attend[1, 32:64] = False  # a whole split of row 1 (4 splits of 32 rows)
    attend[2] = False
    lat = lat.at[:, ~np.asarray(attend).any(0)].set(1e3)  # masked rows with huge values
    kw = dict(softmax_scale=0.125, splits=4, block_rows=16)
    got = np.asarray(mla.mla_decode(q_lat, q_rope, lat, rope, jnp.asarray(attend), interpret=INTERPRET, **kw))
    want = np.asarray(mla.mla_decode_reference(q_lat, q_rope, lat, rope, jnp.asarray(attend), **kw))
    assert np.isnan(got[2]).all() and np.isnan(want[2]).all()
    np.testing.assert_allclose(got[:2], want[:2], rtol=1e-5, atol=1e-5)
    # only the attended rows matter: changing the others changes nothing
    lat2 = jnp.where(jnp.asarray(attend)[..., None], lat, -7.0)
    again = np.asarray(mla.mla_decode(q_lat, q_rope, lat2, rope, jnp.asarray(attend), interpret=INTERPRET, **kw))
    np.testing.assert_array_equal(again[:2], got[:2])


def test_mla_decode_rejects_what_it_cannot_run():
    args = _case(2)
    with pytest.raises(ValueError, match="do not agree"):
        mla.mla_decode(args[0], args[1], args[2][:, :64], *args[3:], softmax_scale=1.0, interpret=INTERPRET)
    with pytest.raises(ValueError, match="power-of-two head_block"):
        mla.mla_decode(*_case(2, h=12), softmax_scale=1.0, interpret=INTERPRET)
    with pytest.raises(ValueError, match="dividing heads 16"):
        mla.mla_decode(*args, softmax_scale=1.0, head_block=32, interpret=INTERPRET)
    with pytest.raises(ValueError, match="splits"):
        mla.mla_decode(*args, softmax_scale=1.0, splits=3, block_rows=16, interpret=INTERPRET)


def test_default_splits():
    assert mla.default_splits(1, 2048, 32) == 64  # batch 1: as many as the row blocks allow up to ~256 programs
    assert mla.default_splits(10, 2048, 32) == 8
    assert mla.default_splits(40, 2048, 32) == 2
    assert mla.default_splits(512, 2048, 32) == 1
    assert mla.default_splits(1, 64, 32) == 2
    assert mla.default_splits(10, 2048, 32, parts=8) == 2  # 4 head blocks x 2 column parts
