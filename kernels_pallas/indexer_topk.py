"""DSA indexer for decode: per-position scores and exact top-k position selection.

Layout follows jax/experimental/pallas/ops/gpu: kernel bodies, wrappers, public
ops, pure-jnp references with the same signatures.

Selection rule (must hold in prefill, decode, verify, resident and offload so that
every path selects the same rows bit for bit):
  * the k highest-scoring positions of a row are selected;
  * equal scores: the lower (earlier) position wins; -0.0 and +0.0 are equal;
  * -inf scores (causally masked or unwritten positions) are selected only when a
    row has fewer than k finite scores; then the lowest -inf positions fill up
    (callers mask them out);
  * the result lists positions in ascending order;
  * NaN scores are a caller bug (undefined selection).

The Pallas selection is a radix select on order-preserving int32 keys, exact and
free of sorting (Triton has no sort primitive):
  1. ``_radix_count_kernel`` (8 passes, 4 bits each, most significant first):
     counts per block how many keys are >= each of 16 candidate thresholds; jnp
     glue sums blocks and keeps the largest candidate with count >= k. After 32
     bits the threshold is exactly the k-th largest key.
  2. ``_tie_count_kernel``: per block, keys > threshold and keys == threshold.
     Glue: exclusive prefix sums over blocks give each block its share of the
     ties (lowest positions first) and its output offset.
  3. ``_compact_kernel``: each block ranks its selected lanes with a cumsum and
     scatters their positions (masked store) into the output row, which is
     therefore written in ascending position order without sorting.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

_RADIX_BITS = 4
_RADIX = 1 << _RADIX_BITS  # 16 candidate thresholds per pass.
_NUM_PASSES = 32 // _RADIX_BITS
_SIGN = np.uint32(0x80000000)


def _is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _compiler_params(num_stages: int):
    # Triton params; the Triton lowering is also the one that runs on ROCm. The
    # interpreter ignores them.
    return plgpu.CompilerParams(num_warps=4, num_stages=num_stages)


# ----------------------------------------------------------------------------
# Indexer scores.
# ----------------------------------------------------------------------------


def _indexer_scores_kernel(
    q_ref,  # [T, Hi, D] q dtype (lane squeezed)
    w_ref,  # [T, Hi] f32
    qpos_ref,  # [T] int32
    plane_ref,  # [S] int32, ANY: the key plane of each lane
    k_ref,  # [P, N, D] key dtype, ANY: every plane's keys, read in place
    o_ref,  # [T, block_keys] f32
    *,
    softmax_scale: float,
    block_keys: int,
):
    j = pl.program_id(1)
    # The plane is read from a ref (Pallas' Triton lowering has no scalar prefetch), and the key block loaded from
    # the whole keys array: a blocked spec needs its block index before the kernel runs, and a gathered [S, N, D]
    # operand would copy every lane's keys per layer and step.
    plane = plane_ref[pl.program_id(0)]
    # bf16 x bf16 products are exact in f32, so with f32 accumulation a bf16 dot
    # equals the upcast f32 dot up to summation order, and runs on tensor cores
    # (the f32 IEEE dot was ~10x slower on an H200). Other dtypes are upcast, with
    # HIGHEST precision: the Triton lowering otherwise uses tf32 for f32 dots.
    both_bf16 = q_ref.dtype == jnp.bfloat16 and k_ref.dtype == jnp.bfloat16
    dot_dtype = jnp.bfloat16 if both_bf16 else jnp.float32
    precision = lax.Precision.DEFAULT if both_bf16 else lax.Precision.HIGHEST
    keys = k_ref[plane, pl.ds(j * block_keys, block_keys), :].astype(dot_dtype)  # [block_keys, D]
    n = j * block_keys + lax.broadcasted_iota(jnp.int32, (block_keys,), 0)
    num_queries = q_ref.shape[0]
    # One [Hi, D] x [D, block_keys] dot per query token: T is small in decode (1,
    # or a few MTP drafts) and a per-token dot needs no in-kernel reshape.
    for t in range(num_queries):
        q = q_ref[t].astype(dot_dtype)  # [Hi, D]
        logits = lax.dot_general(
            q, keys, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
        )  # [Hi, block_keys]
        act = jnp.maximum(logits * softmax_scale, 0.0)
        score = jnp.sum(act * w_ref[t].astype(jnp.float32)[:, None], axis=0)
        o_ref[t] = jnp.where(n > qpos_ref[t], -jnp.inf, score)


def _validate_scores(q, weights, keys, key_plane, query_positions):
    if q.ndim != 4 or keys.ndim != 3:
        raise ValueError(f"expected q[S,T,Hi,D] and keys[P,N,D], got {q.shape} and {keys.shape}")
    S, T, Hi, D = q.shape
    if (keys.shape[2] != D or weights.shape != (S, T, Hi) or query_positions.shape != (S, T)
            or key_plane.shape != (S,)):
        raise ValueError(
            "expected q[S,T,Hi,D], weights[S,T,Hi], keys[P,N,D], key_plane[S], query_positions[S,T]; "
            f"got {q.shape}, {weights.shape}, {keys.shape}, {key_plane.shape}, {query_positions.shape}"
        )
    if not jnp.issubdtype(key_plane.dtype, jnp.integer):
        raise ValueError(f"key_plane must be an integer array, got {key_plane.dtype}")


@functools.partial(jax.jit, static_argnames=("softmax_scale", "block_keys", "interpret"))
def indexer_scores(
    q: jax.Array,
    weights: jax.Array,
    keys: jax.Array,
    key_plane: jax.Array,
    query_positions: jax.Array,
    *,
    softmax_scale: float,
    block_keys: int = 128,
    interpret: bool = False,
) -> jax.Array:
    """DSA indexer scores f32[S, T, N].

    ``score[s,t,n] = sum_h weights[s,t,h] * relu(q[s,t,h] . keys[key_plane[s],n] * softmax_scale)``
    computed in f32, and -inf where ``n > query_positions[s,t]``. Products are exact
    f32 (bf16 pairs go through a bf16 dot with f32 accumulation, anything else is
    upcast to f32); only the summation order differs from the reference.

    Args:
      q: [S, T, Hi, D] (bf16 or f32); Hi and D powers of two.
      weights: [S, T, Hi] f32 per-head weights.
      keys: [P, N, D] indexer keys of every plane (layer and session slot), read
        in place; N a multiple of ``block_keys``.
      key_plane: int32[S], the plane of ``keys`` lane s scores against, in [0, P).
      query_positions: int32[S, T] absolute position of each query token.
      softmax_scale: scale applied to the logits before the relu.
      block_keys: keys per program (power of two).
      interpret: run the Pallas interpreter (CPU tests).
    """
    _validate_scores(q, weights, keys, key_plane, query_positions)
    S, T, Hi, D = q.shape
    N = keys.shape[1]
    if not _is_pow2(block_keys):
        raise ValueError(f"block_keys must be a power of two, got {block_keys}")
    if N % block_keys:
        raise ValueError(f"N={N} keys must be a multiple of block_keys={block_keys}")
    if not (_is_pow2(Hi) and _is_pow2(D)):
        raise ValueError(f"Hi={Hi} and D={D} must be powers of two (Triton tiles)")
    # Pad the query tokens to a power of two; padded rows are sliced off.
    Tp = _next_pow2(T)
    if Tp != T:
        pad = lambda x: jnp.pad(x, [(0, 0), (0, Tp - T)] + [(0, 0)] * (x.ndim - 2))
        q, weights, query_positions = pad(q), pad(weights), pad(query_positions)
    kernel = functools.partial(_indexer_scores_kernel, softmax_scale=float(softmax_scale), block_keys=block_keys)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    out = pl.pallas_call(
        kernel,
        grid=(S, N // block_keys),
        in_specs=[
            pl.BlockSpec((None, Tp, Hi, D), lambda s, j: (s, 0, 0, 0)),
            pl.BlockSpec((None, Tp, Hi), lambda s, j: (s, 0, 0)),
            pl.BlockSpec((None, Tp), lambda s, j: (s, 0)),
            any_spec,
            any_spec,
        ],
        out_specs=pl.BlockSpec((None, Tp, block_keys), lambda s, j: (s, 0, j)),
        out_shape=jax.ShapeDtypeStruct((S, Tp, N), jnp.float32),
        compiler_params=_compiler_params(num_stages=2),
        interpret=interpret,
        name="indexer_scores",
    )(q, weights.astype(jnp.float32), query_positions.astype(jnp.int32), key_plane.astype(jnp.int32), keys)
    return out[:, :T]


@functools.partial(jax.jit, static_argnames=("softmax_scale", "block_keys", "interpret"))
def indexer_scores_reference(
    q: jax.Array,
    weights: jax.Array,
    keys: jax.Array,
    key_plane: jax.Array,
    query_positions: jax.Array,
    *,
    softmax_scale: float,
    block_keys: int = 128,
    interpret: bool = False,
) -> jax.Array:
    """Pure-jnp ``indexer_scores`` (same signature; block_keys/interpret unused)."""
    del block_keys, interpret
    _validate_scores(q, weights, keys, key_plane, query_positions)
    keys = jnp.take(keys, key_plane.astype(jnp.int32), axis=0)  # [S, N, D]
    logits = jnp.einsum(
        "sthd,snd->sthn",
        q.astype(jnp.float32),
        keys.astype(jnp.float32),
        precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )
    act = jnp.maximum(logits * softmax_scale, 0.0)
    score = jnp.sum(act * weights.astype(jnp.float32)[..., None], axis=2)
    n = jnp.arange(keys.shape[1], dtype=jnp.int32)
    return jnp.where(n > query_positions[..., None], -jnp.inf, score)


# ----------------------------------------------------------------------------
# Top-k positions.
# ----------------------------------------------------------------------------


def _sortable_key(x: jax.Array) -> jax.Array:
    """int32 keys ordered like the f32 values, with -0.0 mapped onto +0.0.

    Non-negative floats already order like their bits; negative ones order in
    reverse, so their low 31 bits are flipped.
    """
    x = jnp.where(x == 0.0, 0.0, x)
    bits = lax.bitcast_convert_type(x, jnp.int32)
    return bits ^ ((bits >> 31) & jnp.int32(0x7FFFFFFF))


def _radix_count_kernel(
    x_ref,  # [block_n] f32 scores
    cand_ref,  # [16] int32 candidate thresholds (signed key domain)
    o_ref,  # [16] int32: per candidate, how many keys of the block are >= it
):
    key = _sortable_key(x_ref[...])
    ge = key[None, :] >= cand_ref[...][:, None]  # [16, block_n]
    o_ref[...] = jnp.sum(ge.astype(jnp.int32), axis=1)


def _tie_count_kernel(
    x_ref,  # [block_n] f32 scores
    thr_ref,  # [1] int32 threshold key of the row
    gt_ref,  # [1] int32: keys > threshold in the block
    eq_ref,  # [1] int32: keys == threshold in the block
):
    key = _sortable_key(x_ref[...])
    thr = thr_ref[0]
    gt_ref[0] = jnp.sum((key > thr).astype(jnp.int32))
    eq_ref[0] = jnp.sum((key == thr).astype(jnp.int32))


def _compact_kernel(
    x_ref,  # [block_n] f32 scores
    thr_ref,  # [1] int32 threshold key of the row
    need_eq_ref,  # [1] int32 ties at the threshold the row still takes (>= 1)
    eq_before_ref,  # [1] int32 ties in earlier blocks of the row
    out_off_ref,  # [1] int32 output slot of the block's first selected position
    o_ref,  # [R, k] int32 selected positions, ANY (scattered into)
    *,
    block_n: int,
):
    r = pl.program_id(0)
    b = pl.program_id(1)
    key = _sortable_key(x_ref[...])
    thr = thr_ref[0]
    is_eq = (key == thr).astype(jnp.int32)
    # Ties are taken lowest position first: a tie's global rank among ties decides.
    eq_rank = eq_before_ref[0] + jnp.cumsum(is_eq) - is_eq
    sel = (key > thr) | ((is_eq == 1) & (eq_rank < need_eq_ref[0]))
    sel_i = sel.astype(jnp.int32)
    dest = out_off_ref[0] + jnp.cumsum(sel_i) - sel_i  # [block_n]
    n = b * block_n + lax.broadcasted_iota(jnp.int32, (block_n,), 0)
    # Blocks own disjoint, contiguous slot ranges, so the scatter has no conflicts.
    plgpu.store(o_ref.at[r, dest], n, mask=sel)


def _row_block_spec(block_n: int):
    return pl.BlockSpec((None, block_n), lambda r, b: (r, b))


def _per_row_spec():
    return pl.BlockSpec((None, 1), lambda r, b: (r, 0))


def _per_block_spec():
    return pl.BlockSpec((None, 1), lambda r, b: (r, b))


@functools.partial(jax.jit, static_argnames=("k", "block_n", "interpret"))
def topk_positions(
    scores: jax.Array,
    k: int,
    *,
    block_n: int = 1024,
    interpret: bool = False,
) -> jax.Array:
    """Positions of the k highest scores per row, ascending (see module rule).

    Args:
      scores: f32[S, T, N].
      k: number of positions per row, 1 <= k <= N.
      block_n: scores per program (power of two); N is padded with -inf to a
        multiple of min(block_n, next_pow2(N)). Padding sits above every real
        position, so it is never chosen over a real -inf.
      interpret: run the Pallas interpreter (CPU tests).

    Returns:
      int32[S, T, k].
    """
    S, T, N = scores.shape
    if not 1 <= k <= N:
        raise ValueError(f"k={k} must be in [1, N={N}]")
    if not _is_pow2(block_n):
        raise ValueError(f"block_n must be a power of two, got {block_n}")
    R = S * T
    block_n = min(block_n, _next_pow2(N))
    nb = -(-N // block_n)
    x = scores.astype(jnp.float32).reshape(R, N)
    if nb * block_n != N:
        x = jnp.pad(x, [(0, 0), (0, nb * block_n - N)], constant_values=-jnp.inf)
    grid = (R, nb)
    common = dict(grid=grid, interpret=interpret)

    count_ge = pl.pallas_call(
        _radix_count_kernel,
        in_specs=[_row_block_spec(block_n), pl.BlockSpec((None, _RADIX), lambda r, b: (r, 0))],
        out_specs=pl.BlockSpec((None, None, _RADIX), lambda r, b: (r, b, 0)),
        out_shape=jax.ShapeDtypeStruct((R, nb, _RADIX), jnp.int32),
        compiler_params=_compiler_params(num_stages=1),
        name="topk_radix_count",
        **common,
    )

    # Threshold search in the unsigned domain u = key ^ SIGN, where candidates are
    # a prefix plus one more digit; invariant: count(keys >= prefix) >= k.
    digits = jnp.arange(_RADIX, dtype=jnp.uint32)

    def radix_pass(p, prefix):  # prefix: uint32[R]
        shift = jnp.uint32(32 - _RADIX_BITS) - jnp.uint32(_RADIX_BITS) * p.astype(jnp.uint32)
        cand_u = prefix[:, None] | (digits[None, :] << shift)
        cand = lax.bitcast_convert_type(cand_u ^ _SIGN, jnp.int32)
        counts = count_ge(x, cand).sum(axis=1)  # [R, 16], non-increasing in digit
        digit = jnp.sum(counts >= k, axis=1).astype(jnp.uint32) - 1
        return prefix | (digit << shift)

    # Unrolled: XLA's GPU runtime launches the kernels of a while loop one by one, outside the command buffers
    # (CUDA graphs) that carry the rest of the step, so a rolled loop cost 6 host launches x 8 passes per indexer
    # layer per decode step, and batch-1 decode was bound by how fast the host could launch (measured with
    # experiments.profile_decode: 192 lone launches per step). The pass kernel is still compiled once.
    prefix = lax.fori_loop(0, _NUM_PASSES, radix_pass, jnp.zeros((R,), jnp.uint32), unroll=True)
    thr = lax.bitcast_convert_type(prefix ^ _SIGN, jnp.int32)[:, None]  # [R, 1]

    gt, eq = pl.pallas_call(
        _tie_count_kernel,
        in_specs=[_row_block_spec(block_n), _per_row_spec()],
        out_specs=[_per_block_spec(), _per_block_spec()],
        out_shape=[jax.ShapeDtypeStruct((R, nb), jnp.int32)] * 2,
        compiler_params=_compiler_params(num_stages=1),
        name="topk_tie_count",
        **common,
    )(x, thr)

    need_eq = k - jnp.sum(gt, axis=1, keepdims=True)  # [R, 1], >= 1
    eq_before = jnp.cumsum(eq, axis=1) - eq
    taken = gt + jnp.clip(need_eq - eq_before, 0, eq)
    out_off = jnp.cumsum(taken, axis=1) - taken

    out = pl.pallas_call(
        functools.partial(_compact_kernel, block_n=block_n),
        in_specs=[_row_block_spec(block_n), _per_row_spec(), _per_row_spec(), _per_block_spec(), _per_block_spec()],
        out_specs=pl.BlockSpec(memory_space=pl.ANY),
        out_shape=jax.ShapeDtypeStruct((R, k), jnp.int32),
        compiler_params=_compiler_params(num_stages=1),
        name="topk_compact",
        **common,
    )(x, thr, need_eq, eq_before, out_off)
    return out.reshape(S, T, k)


@functools.partial(jax.jit, static_argnames=("k", "block_n", "interpret"))
def topk_positions_reference(
    scores: jax.Array,
    k: int,
    *,
    block_n: int = 1024,
    interpret: bool = False,
) -> jax.Array:
    """Pure-jnp ``topk_positions``: stable ``lax.top_k``, then ascending sort.

    ``lax.top_k`` orders -0.0 below +0.0, so zeros are canonicalised first to keep
    the "equal scores: lower position wins" rule.
    """
    del block_n, interpret
    N = scores.shape[-1]
    if not 1 <= k <= N:
        raise ValueError(f"k={k} must be in [1, N={N}]")
    x = scores.astype(jnp.float32)
    x = jnp.where(x == 0.0, 0.0, x)
    _, idx = lax.top_k(x, k)
    return jnp.sort(idx, axis=-1).astype(jnp.int32)
