"""Row arithmetic on indices that are never negative (positions, pages, slots, ring rows), for the jnp code around
the kernels and in their references.

jnp's ``%`` and ``//`` follow Python's signs, and its default ``take`` wraps negative indices and masks those out of
range: each costs a few compares and selects per element that these indices never need. On the CPU, XLA copies such
elementwise chains into every fusion that reads their result, so they multiply: in a tiny offload engine's MTP 3
verify step they were a quarter of its ~19,000 optimised instructions, and the test suite's time is mostly XLA
compiling such steps. A power of two (ring rows, page rows, hot slots in the configs) becomes a mask or a shift,
anything else XLA's truncating ``rem`` / ``div``, which agree with Python's for these operands. The results are the
same integers either way, so nothing downstream can tell.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def _check(m: int) -> int:
    if int(m) != m or m <= 0:
        raise ValueError(f"the divisor must be a positive static integer, got {m!r}")
    return int(m)


def rem(x: jax.Array, m: int) -> jax.Array:
    """``x % m`` for integer ``x >= 0`` (not checked) and a static ``m > 0``."""
    m = _check(m)
    if m & (m - 1) == 0:
        return x & jnp.asarray(m - 1, x.dtype)
    return lax.rem(x, jnp.asarray(m, x.dtype))


def div(x: jax.Array, m: int) -> jax.Array:
    """``x // m`` for integer ``x >= 0`` (not checked) and a static ``m > 0``."""
    m = _check(m)
    if m & (m - 1) == 0:
        return lax.shift_right_logical(x, jnp.asarray(m.bit_length() - 1, x.dtype))
    return lax.div(x, jnp.asarray(m, x.dtype))


def take_rows(a: jax.Array, index: jax.Array, axis: int | None = None) -> jax.Array:
    """``jnp.take(a, index, axis)`` for indices known to lie in range: XLA's gather clamps them, which for such indices
    changes nothing, instead of jnp's default wrapping of negative indices and masking of out-of-range ones."""
    return jnp.take(a, index, axis=axis, mode="clip")
