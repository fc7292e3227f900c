"""kernels_pallas.index_math: the cheaper row arithmetic equals jnp's ``%``, ``//`` and ``take`` on the indices it is
for (never negative, in range), for power-of-two divisors (mask, shift) and others (truncating rem / div)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kernels_pallas import index_math as im

# One compiled program per (divisor, dtype): the values vary, the shapes do not.
_SIZE = 64


@settings(max_examples=30, deadline=None)
@given(st.sampled_from([1, 2, 3, 16, 48, 64, 100, 4096, 2**30]), st.sampled_from(["int32", "int16"]),
       st.integers(0, 2**31 - 1))
def test_rem_and_div_equal_pythons_on_non_negative_values(m, dtype, seed):
    info = np.iinfo(dtype)
    if m > info.max:
        m = int(info.max)
    rng = np.random.default_rng(seed)
    x = rng.integers(0, info.max, size=_SIZE, endpoint=True).astype(dtype)
    x[:4] = [0, min(m, info.max), info.max, max(m - 1, 0)]
    got_rem, got_div = jax.jit(lambda v: (im.rem(v, m), im.div(v, m)))(jnp.asarray(x))
    assert got_rem.dtype == got_div.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(np.asarray(got_rem), x % m)
    np.testing.assert_array_equal(np.asarray(got_div), x // m)


def test_take_rows_equals_take_on_in_range_indices():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(37, 5)).astype(np.float32)
    idx = rng.integers(0, 37, size=(4, 9)).astype(np.int32)
    idx[0, :2] = [0, 36]
    np.testing.assert_array_equal(np.asarray(im.take_rows(jnp.asarray(a), jnp.asarray(idx), axis=0)),
                                  np.asarray(jnp.take(jnp.asarray(a), jnp.asarray(idx), axis=0)))
    flat = jnp.asarray(a).reshape(-1)
    np.testing.assert_array_equal(np.asarray(im.take_rows(flat, jnp.asarray(idx) * 5 + 4)), a.reshape(-1)[idx * 5 + 4])


@pytest.mark.parametrize("m", [0, -4, 2.5])
def test_a_divisor_that_is_not_a_positive_integer_is_refused(m):
    with pytest.raises(ValueError, match="positive static integer"):
        im.rem(jnp.arange(4), m)
    with pytest.raises(ValueError, match="positive static integer"):
        im.div(jnp.arange(4), m)


def test_the_steps_glue_has_fewer_instructions_than_jnps():
    """What the module is for: a classify-like expression compiles to fewer optimised instructions than the same
    expression with jnp's signed ``%`` / ``//`` and default ``take`` (the saving the step programs rely on)."""
    table = jnp.arange(4 * 64, dtype=jnp.int32)

    def jnp_way(p):
        return jnp.take(table, (p // 16) * 7 + p % 16) + p % 48

    def im_way(p):
        return im.take_rows(table, im.div(p, 16) * 7 + im.rem(p, 16)) + im.rem(p, 48)

    p = jnp.arange(96, dtype=jnp.int32) * 2
    np.testing.assert_array_equal(np.asarray(jax.jit(jnp_way)(p)), np.asarray(jax.jit(im_way)(p)))

    def count(f):
        text = jax.jit(f).lower(p).compile().as_text()
        return sum(1 for line in text.splitlines() if " = " in line and line.startswith("  "))

    assert count(im_way) < count(jnp_way)
