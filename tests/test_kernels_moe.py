"""Pallas grouped matmul (MoE experts; interpreted on CPU, compiled on a GPU) vs ``jax.lax.ragged_dot``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kernels_pallas.grouped_matmul import (_schedule, dequantize_blocks, grouped_matmul, grouped_matmul_reference,
                                            grouped_swiglu, grouped_swiglu_reference, quantize_blocks)

INTERPRET = jax.default_backend() not in ("gpu", "cuda", "rocm")


def _inputs(sizes, K, N, dtype, seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    M = int(sum(sizes))
    x = jax.random.normal(k1, (M, K)).astype(dtype)
    w = (jax.random.normal(k2, (len(sizes), K, N)) / np.sqrt(K)).astype(dtype)
    return x, w, jnp.asarray(sizes, jnp.int32)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize("sizes", [
    [3, 0, 1, 4],  # decode: 2 tokens x 4 routed experts of 4, one expert unused (no visit, no bytes)
    [40, 0, 0, 77, 1, 2, 0, 8],  # prefill-like: groups crossing 16-row tiles, empty groups, a 1-row group
])
def test_grouped_matmul_matches_ragged_dot(sizes, dtype, tol):
    x, w, gs = _inputs(sizes, 64, 128, dtype)
    got = grouped_matmul(x, w, gs, block_m=16, block_k=32, interpret=INTERPRET)
    want = grouped_matmul_reference(x, w, gs)
    assert got.shape == want.shape == (sum(sizes), 128) and got.dtype == dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=9), st.sampled_from([8, 16, 64]))
def test_schedule_visits_every_row_once(sizes, block_m):
    """Each row's group is visited on the row's tile exactly once; no visit lies outside its group's tiles."""
    M = sum(sizes)
    tiles = max(1, -(-M // block_m))
    tile, group, start, end = (np.asarray(a) for a in _schedule(jnp.asarray(sizes, jnp.int32), tiles, block_m))
    G = len(sizes)
    bounds = np.cumsum([0] + list(sizes))
    covered = np.zeros(M, int)
    for t, g, s, e in zip(tile, group, start, end):
        if g == G:
            continue
        assert sizes[g] > 0 and (s, e) == (bounds[g], bounds[g + 1])
        assert s // block_m <= t <= (e - 1) // block_m
        rows = np.arange(t * block_m, (t + 1) * block_m)
        covered[rows[(rows >= s) & (rows < e)]] += 1
    assert np.all(covered == 1)
    assert len(tile) == tiles + G - 1


def test_grouped_matmul_validation():
    x, w, gs = _inputs([2, 2], 64, 128, jnp.float32)
    with pytest.raises(ValueError, match="disagree"):
        grouped_matmul(x, w[:, :32], gs, interpret=INTERPRET)
    with pytest.raises(ValueError, match="multiple of block_k"):
        grouped_matmul(x, w, gs, block_k=48, interpret=INTERPRET)


@pytest.mark.parametrize("sizes", [[3, 0, 1, 4], [40, 0, 0, 77, 1, 2, 0, 8]])
def test_fp8_weights_equal_dequantised_weights(sizes):
    """FP8 expert weights dequantised inside the kernel, block by block, multiply the same bf16 operands as the
    weights dequantised beforehand: bit-identical in the interpreter and the reference; compiled for the H200 the
    converted operand takes another MMA path (its summation order differs), so there it is equal to bf16 rounding."""
    x, w, gs = _inputs(sizes, 256, 128, jnp.bfloat16, seed=4)
    w = w * jnp.linspace(0.1, 10.0, 256)[None, :, None].astype(w.dtype)  # scales differ across blocks
    w8, scale = quantize_blocks(w)
    assert w8.dtype == jnp.float8_e4m3fn and scale.shape == (len(sizes), 2, 1)
    deq = dequantize_blocks(w8, scale, jnp.bfloat16)
    np.testing.assert_allclose(np.asarray(deq, np.float32), np.asarray(w, np.float32), rtol=2 ** -4, atol=1e-3)
    got = grouped_matmul(x, w8, gs, scale, block_m=16, interpret=INTERPRET)
    want = grouped_matmul(x, deq, gs, block_m=16, interpret=INTERPRET)
    if INTERPRET:
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    else:
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2 ** -7, atol=1e-2)
    ref = grouped_matmul_reference(x, w8, gs, scale)
    np.testing.assert_array_equal(np.asarray(ref, np.float32), np.asarray(grouped_matmul_reference(x, deq, gs),
                                                                           np.float32))
    with pytest.raises(ValueError, match="need their w_scale"):
        grouped_matmul(x, w8, gs, interpret=INTERPRET)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize("sizes", [[3, 0, 1, 4], [40, 0, 0, 77, 1, 2, 0, 8]])
def test_grouped_swiglu_is_the_two_products_in_one_launch(sizes, dtype, tol):
    """One launch computes what two grouped matmuls and the SwiGLU after them compute: bit for bit in the
    interpreter (each product rounded to the output dtype before the SwiGLU, as there); on a GPU to the rounding
    of the elementwise part, which Triton and XLA may evaluate in other precisions. Close to the reference."""
    x, wg, gs = _inputs(sizes, 64, 128, dtype, seed=1)
    _, wu, _ = _inputs(sizes, 64, 128, dtype, seed=2)
    got = grouped_swiglu(x, wg, wu, gs, block_m=16, block_k=32, interpret=INTERPRET)
    two = (jax.nn.silu(grouped_matmul(x, wg, gs, block_m=16, block_k=32, interpret=INTERPRET))
           * grouped_matmul(x, wu, gs, block_m=16, block_k=32, interpret=INTERPRET)).astype(dtype)
    assert got.shape == (sum(sizes), 128) and got.dtype == dtype
    if INTERPRET:
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(two, np.float32))
    else:
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(two, np.float32), rtol=tol, atol=tol)
    want = grouped_swiglu_reference(x, wg, wu, gs)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)


def test_grouped_swiglu_fp8_and_validation():
    sizes = [3, 0, 1, 4]
    x, wg, gs = _inputs(sizes, 256, 128, jnp.bfloat16, seed=5)
    _, wu, _ = _inputs(sizes, 256, 128, jnp.bfloat16, seed=6)
    (g8, gsc), (u8, usc) = quantize_blocks(wg), quantize_blocks(wu)
    got = grouped_swiglu(x, g8, u8, gs, gsc, usc, block_m=16, interpret=INTERPRET)
    deq = grouped_swiglu(x, dequantize_blocks(g8, gsc, jnp.bfloat16), dequantize_blocks(u8, usc, jnp.bfloat16), gs,
                         block_m=16, interpret=INTERPRET)
    if INTERPRET:  # dequantised in the kernel block by block: the same bf16 operands (see the FP8 test above)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(deq, np.float32))
    np.testing.assert_allclose(np.asarray(got, np.float32),
                               np.asarray(grouped_swiglu_reference(x, g8, u8, gs, gsc, usc), np.float32),
                               rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="must agree"):
        grouped_swiglu(x, wg, wu[:, :, :64], gs, interpret=INTERPRET)
    with pytest.raises(ValueError, match="need their w_scale"):
        grouped_swiglu(x, g8, u8, gs, interpret=INTERPRET)
