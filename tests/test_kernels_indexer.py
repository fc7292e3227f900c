"""Pallas indexer scores and top-k selection (interpreted on CPU) vs references."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

from kernels_pallas import indexer_scores, indexer_scores_reference, topk_positions, topk_positions_reference
from kernels_pallas.kv_formats import to_stored
from kernels_pallas.indexer_topk import (BLOCK_TOTALS, CHUNK_QUERIES, FP8_MAX, dequantize_index_keys,
                                         quantize_index_keys, selectable_positions)

# Interpreted on the CPU, compiled on a GPU: the same tests check the real kernels on the H200.
INTERPRET = jax.default_backend() not in ("gpu", "cuda", "rocm")


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5, 6))
def _indexer_inputs(S, T, Hi, D, N, dtype, seed=0):
    """Lane s scores against key plane ``KEY_PLANE[s]`` of S + 1 planes (lanes need not be planes, and may share)."""
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (S, T, Hi, D)).astype(dtype)
    w = jax.random.normal(ks[1], (S, T, Hi), jnp.float32)  # signed: yields -0.0 too
    keys = jax.random.normal(ks[2], (S + 1, N, D)).astype(dtype)
    qpos = jax.random.randint(ks[3], (S, T), 0, N)
    key_plane = (S - jnp.arange(S, dtype=jnp.int32)) % (S + 1)  # [S, S-1, ...]: reversed, skipping plane 0
    return q, w, keys, key_plane, qpos


_SCORE_KW = dict(softmax_scale=0.125, block_keys=64)


@pytest.mark.parametrize("dtype,T", [(jnp.bfloat16, 3), (jnp.float32, 1)])
def test_scores_match_reference(dtype, T):
    S, Hi, D, N = 2, 8, 32, 128
    q, w, keys, key_plane, qpos = _indexer_inputs(S, T, Hi, D, N, dtype)
    # Causal edges: the first position, the last one, and beyond the written length.
    qpos = qpos.at[0, 0].set(0).at[1, -1].set(N - 1)
    if T > 1:
        qpos = qpos.at[0, 1].set(N + 5)
    kw = _SCORE_KW
    got = indexer_scores(q, w, keys, key_plane, qpos, interpret=INTERPRET, **kw)
    want = indexer_scores_reference(q, w, keys, key_plane, qpos, **kw)
    assert got.shape == (S, T, N) and got.dtype == jnp.float32
    got, want = np.asarray(got), np.asarray(want)
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    n = np.arange(N)
    np.testing.assert_array_equal(np.isneginf(want), n > np.asarray(qpos)[..., None])
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-5, atol=1e-5)
    # Each lane scored against its own plane: the reference on that plane alone agrees (up to summation order,
    # which a GPU's einsum may choose by shape).
    for s in range(S):
        alone = np.asarray(indexer_scores_reference(q[s:s + 1], w[s:s + 1], keys[key_plane[s]][None],
                                                    jnp.zeros((1,), jnp.int32), qpos[s:s + 1], **kw))[0]
        np.testing.assert_array_equal(np.isneginf(alone), np.isneginf(want[s]))
        np.testing.assert_allclose(alone[finite[s]], want[s][finite[s]], rtol=1e-5, atol=1e-5)


def test_scores_validation():
    q, w, keys, key_plane, qpos = _indexer_inputs(1, 1, 4, 16, 96, jnp.float32)
    with pytest.raises(ValueError, match="multiple of block_keys"):
        indexer_scores(q, w, keys, key_plane, qpos, softmax_scale=1.0, block_keys=64, interpret=INTERPRET)
    with pytest.raises(ValueError, match="block_keys must be a power of two"):
        indexer_scores(q, w, keys, key_plane, qpos, softmax_scale=1.0, block_keys=48, interpret=INTERPRET)
    with pytest.raises(ValueError, match="expected q"):
        indexer_scores(q, w[:, :, :2], keys, key_plane, qpos, softmax_scale=1.0, block_keys=32, interpret=INTERPRET)
    with pytest.raises(ValueError, match="key_plane"):
        indexer_scores_reference(q, w, keys, jnp.zeros((2,), jnp.int32), qpos, softmax_scale=1.0)


def _check_topk(scores, k, block_n=64, query_positions=None):
    """Both ways of summing the blocks' counts select exactly the reference's positions."""
    scores = jnp.asarray(scores, jnp.float32)
    want = topk_positions_reference(scores, k)
    for block_totals in BLOCK_TOTALS:
        got = topk_positions(scores, k, query_positions, block_n=block_n, block_totals=block_totals,
                             interpret=INTERPRET)
        assert got.shape == (*scores.shape[:-1], k) and got.dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=block_totals)
    got = np.asarray(got)
    assert np.all(np.diff(got, axis=-1) > 0), "ascending, no duplicates"
    return got


def _rng_scores(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# Most top-k tests share one shape and k so the interpreted kernels compile once.
# N = 200 is not a multiple of block_n = 64: the wrapper pads with -inf.
_SHAPE, _K = (2, 3, 200), 64


def test_topk_random():
    _check_topk(_rng_scores(_SHAPE, 0), _K)


def test_topk_many_ties():
    x = _rng_scores(_SHAPE, 1)
    x = np.round(x * 2) / 2  # a handful of distinct values
    x = np.where(x < 0, 0.0, x)  # relu zeros ...
    x[..., ::3] *= -1.0  # ... with -0.0 among them (equal to +0.0)
    got = _check_topk(x, _K)
    # Ties at the threshold go to the lowest positions.
    row = x[0, 0]
    thr = np.sort(row)[::-1][_K - 1]
    tied = np.flatnonzero(row == thr)
    taken = np.intersect1d(got[0, 0], tied)
    assert 0 < len(taken) < len(tied)
    np.testing.assert_array_equal(taken, tied[: len(taken)])


def test_topk_all_equal_and_k_equals_n():
    _check_topk(np.zeros(_SHAPE, np.float32), _K)
    _check_topk(_rng_scores(_SHAPE, 2), _SHAPE[-1])


def test_topk_fewer_finite_than_k():
    x = _rng_scores(_SHAPE, 3)
    x[0, 0, 10:] = -np.inf  # 10 finite entries
    x[0, 1, :] = -np.inf  # none
    x[0, 2, ::2] = -np.inf
    x[1, 0, :150] = -np.inf  # the finite tail and the lowest -inf positions
    got = _check_topk(x, _K)
    np.testing.assert_array_equal(got[0, 0], np.arange(_K))  # finite, then lowest -inf
    np.testing.assert_array_equal(got[0, 1], np.arange(_K))
    np.testing.assert_array_equal(got[1, 0], np.r_[np.arange(14), np.arange(150, 200)])


def test_topk_small_n_and_k1():
    _check_topk(_rng_scores((3, 2, 20), 4), 1, block_n=1024)  # N < block_n


def test_topk_on_indexer_scores():
    """End to end: causal -inf tails, relu zeros of both signs, S,T > 1."""
    # Same shapes as test_scores_match_reference: the compiled kernel is reused.
    q, w, keys, key_plane, qpos = _indexer_inputs(2, 3, 8, 32, 128, jnp.bfloat16, seed=5)
    qpos = qpos.at[0, 0].set(20)
    scores = indexer_scores(q, w, keys, key_plane, qpos, interpret=INTERPRET, **_SCORE_KW)
    assert np.any(np.asarray(scores) == 0)
    scores = jnp.pad(scores, [(0, 0), (0, 0), (0, _SHAPE[-1] - 128)], constant_values=-jnp.inf)
    _check_topk(scores, _K)


def test_topk_validation():
    x = jnp.zeros((1, 1, 64), jnp.float32)
    with pytest.raises(ValueError, match="k=65"):
        topk_positions(x, 65, interpret=INTERPRET)
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        topk_positions(x, 4, block_n=100, interpret=INTERPRET)
    with pytest.raises(ValueError, match="block_totals must be one of"):
        topk_positions(x, 4, block_totals="sorted", interpret=INTERPRET)


_VALUES = [-np.inf, -2.0, -1.0, -0.0, 0.0, 0.5, 1.0, 3.0, 1e30]


@settings(max_examples=10, deadline=None)
@given(
    values=st.lists(st.sampled_from(_VALUES), min_size=int(np.prod(_SHAPE)), max_size=int(np.prod(_SHAPE))),
    k=st.sampled_from([_K, _SHAPE[-1]]),
)
def test_topk_property_exact_ties(values, k):
    _check_topk(np.asarray(values, np.float32).reshape(_SHAPE), k)


# ---- chunk (prefill) scores, FP8 keys, precisions, live-history bounds ----

def _check_scores(got, want, qpos, rtol=1e-5, atol=1e-5):
    got, want = np.asarray(got), np.asarray(want)
    n = np.arange(want.shape[-1])
    np.testing.assert_array_equal(np.isneginf(want), n > np.asarray(qpos)[..., None])
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_chunk_scores_match_reference(dtype):
    """More than MAX_DECODE_QUERIES queries per lane: the chunk kernel (queries in blocks of CHUNK_QUERIES, heads
    accumulated one at a time), with a ragged last query block and causal key blocks skipped."""
    S, T, Hi, D, N = 2, CHUNK_QUERIES + 5, 4, 32, 256
    q, w, keys, key_plane, _ = _indexer_inputs(S, T, Hi, D, N, dtype, seed=7)
    # A prefill chunk: consecutive positions, the second lane further into its history.
    qpos = jnp.stack([jnp.arange(T, dtype=jnp.int32), 100 + jnp.arange(T, dtype=jnp.int32)])
    kw = _SCORE_KW
    got = indexer_scores(q, w, keys, key_plane, qpos, interpret=INTERPRET, **kw)
    want = indexer_scores_reference(q, w, keys, key_plane, qpos, **kw)
    assert got.shape == (S, T, N)
    _check_scores(got, want, qpos)


@pytest.mark.parametrize("T", [2, CHUNK_QUERIES + 1])
@pytest.mark.parametrize("precision", ["highest", "bf16", "fp8"])
def test_fp8_keys_scores(T, precision):
    """FP8 keys (e4m3 + one scale per key) on both kernels and every precision: kernel == reference, and the
    scores follow the dequantised keys' (within the queries' own rounding at bf16 / fp8)."""
    S, Hi, D, N = 2, 4, 32, 128
    q, w, keys, key_plane, _ = _indexer_inputs(S, T, Hi, D, N, jnp.bfloat16, seed=11)
    keys = keys * jnp.linspace(0.01, 30.0, N)[None, :, None].astype(keys.dtype)  # scales differ per key
    k8, scale = quantize_index_keys(keys)
    qpos = jnp.minimum(jnp.arange(T, dtype=jnp.int32)[None, :] * 9 + jnp.array([[3], [60]]), N - 1)
    kw = dict(_SCORE_KW, precision=precision)
    got = indexer_scores(q, w, k8, key_plane, qpos, scale, interpret=INTERPRET, **kw)
    want = indexer_scores_reference(q, w, k8, key_plane, qpos, scale, **kw)
    _check_scores(got, want, qpos, rtol=2e-5, atol=1e-4)
    exact = indexer_scores_reference(q.astype(jnp.float32), w, dequantize_index_keys(k8, scale), key_plane, qpos,
                                     **_SCORE_KW)
    tol = {"highest": 1e-4, "bf16": 2e-2, "fp8": 2e-1}[precision]
    _check_scores(want, exact, qpos, rtol=tol, atol=tol * float(jnp.abs(exact[jnp.isfinite(exact)]).max()))


@pytest.mark.parametrize("keys_kind,T", [("bf16", 3), ("fp8", 2), ("fp8", CHUNK_QUERIES + 1)])
def test_keys_stored_as_bits_score_as_their_values(keys_kind, T):
    """Keys as the caches hold them, their bits (uint16 / uint8, kv_formats.stored_dtype) with ``key_dtype``: the
    same scores, bit for bit, as the values themselves, in the kernel and the reference; bits without their
    dtype, or bits of another width, are refused."""
    S, Hi, D, N = 2, 4, 32, 128
    q, w, keys, key_plane, qpos = _indexer_inputs(S, T, Hi, D, N, jnp.bfloat16, seed=12)
    scale, precision = None, "highest"
    if keys_kind == "fp8":
        (keys, scale), precision = quantize_index_keys(keys), "fp8"
    bits = to_stored(keys)
    assert bits.dtype == (jnp.uint16 if keys_kind == "bf16" else jnp.uint8)
    kw = dict(_SCORE_KW, precision=precision)
    for fn, extra in ((indexer_scores, dict(interpret=INTERPRET)), (indexer_scores_reference, {})):
        want = np.asarray(fn(q, w, keys, key_plane, qpos, scale, **kw, **extra))
        got = np.asarray(fn(q, w, bits, key_plane, qpos, scale, key_dtype=keys.dtype, **kw, **extra))
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match=f"indexer keys of {bits.dtype} are not float values"):
        indexer_scores_reference(q, w, bits, key_plane, qpos, scale, **kw)  # bits read as if values
    with pytest.raises(ValueError, match="neither"):
        indexer_scores_reference(q, w, bits.astype(jnp.int32), key_plane, qpos, scale, key_dtype=keys.dtype, **kw)


def test_precision_validation():
    q, w, keys, key_plane, qpos = _indexer_inputs(1, 1, 4, 16, 128, jnp.bfloat16)
    with pytest.raises(ValueError, match="needs fp8 index keys"):
        indexer_scores_reference(q, w, keys, key_plane, qpos, softmax_scale=1.0, precision="fp8")
    with pytest.raises(ValueError, match="precision must be one of"):
        indexer_scores_reference(q, w, keys, key_plane, qpos, softmax_scale=1.0, precision="tf32")
    k8, scale = quantize_index_keys(keys)
    with pytest.raises(ValueError, match="key_scale"):
        indexer_scores_reference(q, w, k8, key_plane, qpos, softmax_scale=1.0)
    with pytest.raises(ValueError, match="key_scale"):
        indexer_scores_reference(q, w, keys, key_plane, qpos, scale, softmax_scale=1.0)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.floats(-1e4, 1e4, width=32), min_size=16, max_size=16),
       st.floats(1e-6, 1e3))
@example(values=[0.0] * 15 + [3.514307046882175e-31], magnitude=1e-6)  # amax / 448 subnormal: a zero scale once
def test_fp8_key_error_bound(values, magnitude):
    """e4m3 keeps 3 mantissa bits: each element within 2**-4 of its value above e4m3's normal range (2**-6 of the
    scale's 448), within half a subnormal step (2**-10 * scale) below it."""
    k = jnp.asarray(np.asarray(values, np.float32) * np.float32(magnitude))[None]
    k8, scale = quantize_index_keys(k)
    back = np.asarray(dequantize_index_keys(k8, scale))[0]
    k, scale = np.asarray(k)[0], float(scale[0])
    assert np.all(np.isfinite(back))
    assert np.abs(k).max() == 0 or np.isclose(np.abs(back).max(), np.abs(k).max(), rtol=2 ** -4)
    bound = 2.0 ** -4 * np.abs(k) + 2.0 ** -10 * scale + 1e-6 * np.abs(k)
    assert np.all(np.abs(back - k) <= bound), (k, back, scale)
    assert scale * FP8_MAX >= np.abs(k).max() * (1 - 1e-6)


def test_topk_live_bound_changes_nothing():
    """Rows causal at their query position: the kernel reads only max(q + 1, k) leading positions, and selects
    exactly what it selects over the whole row (rows with fewer than k finite scores included)."""
    S, T, N = 2, 3, 200
    qpos = jnp.asarray([[5, 70, 199], [0, 63, 130]], jnp.int32)
    x = _rng_scores((S, T, N), 9)
    x = np.where(np.arange(N) > np.asarray(qpos)[..., None], -np.inf, x)
    x[1, 2, :20] = 0.0  # ties inside the live part
    assert np.array_equal(np.asarray(selectable_positions(qpos, _K, N)), [[64, 71, 200], [64, 64, 131]])
    got = _check_topk(x, _K, query_positions=qpos)
    np.testing.assert_array_equal(got, np.asarray(topk_positions(jnp.asarray(x), _K, block_n=64,
                                                                 interpret=INTERPRET)))
    np.testing.assert_array_equal(got[0, 0], np.arange(_K))  # 6 finite, then the lowest -inf positions


def test_compiled_scores_refuse_fp8_keys_they_would_misaddress():
    """FP8 keys of 2**31..2**32 elements lower with 32-bit offsets that go negative past 2**31 (here 144 planes x
    200,064 positions x 128: 3.7 GB), so the compiled kernel refuses them at trace time; past 2**32 bytes the
    offsets are 64-bit, and the interpreter (XLA gathers) addresses any size. Shapes only: nothing is allocated."""
    S = jax.ShapeDtypeStruct
    args = lambda N: (S((4, 1, 32, 128), jnp.bfloat16), S((4, 1, 32), jnp.float32), S((144, N, 128), jnp.float8_e4m3fn),
                      S((4,), jnp.int32), S((4, 1), jnp.int32), S((144, N), jnp.float32))
    fn = lambda interpret: functools.partial(indexer_scores, softmax_scale=0.1, precision="fp8", interpret=interpret)
    with pytest.raises(ValueError, match="negative 32-bit offsets"):
        jax.eval_shape(fn(False), *args(200_064))
    jax.eval_shape(fn(True), *args(200_064))
    jax.eval_shape(fn(False), *args(400_128))


def test_scores_and_topk_of_nothing_and_integer_arguments():
    """No lanes, no query rows or no keys give empty results from the kernels as from the references (a grid of
    zero programs failed in the interpreter with a slice error); float positions, a float k and scores of another
    rank are named."""
    q, w, keys, key_plane, qpos = _indexer_inputs(2, 1, 4, 16, 64, jnp.float32)
    kw = dict(softmax_scale=1.0, block_keys=32)
    for fn in (functools.partial(indexer_scores, interpret=INTERPRET), indexer_scores_reference):
        assert fn(q[:0], w[:0], keys, key_plane[:0], qpos[:0], **kw).shape == (0, 1, 64)
        assert fn(q, w, keys[:, :0], key_plane, qpos, **kw).shape == (2, 1, 0)
        with pytest.raises(ValueError, match="query_positions must be an integer array"):
            fn(q, w, keys, key_plane, qpos.astype(jnp.float32), **kw)
    x = jnp.zeros((2, 3, 64), jnp.float32)
    for fn in (functools.partial(topk_positions, interpret=INTERPRET), topk_positions_reference):
        for empty in (x[:0], x[:, :0]):
            got = fn(empty, 4)
            assert got.shape == (*empty.shape[:2], 4) and got.dtype == jnp.int32
        with pytest.raises(ValueError, match="must be an int"):
            fn(x, 4.0)
    with pytest.raises(ValueError, match=r"scores must be \[S, T, N\]"):
        topk_positions(x[0], 4, interpret=INTERPRET)
