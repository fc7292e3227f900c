"""DSA indexer: per-position scores and exact top-k position selection, for decode and prefill.

Scores come from two kernels: a per-token one for decode and MTP verify (a few query rows against every key) and a
chunk one for prefill and append (64 queries per program, one head at a time, so the per-head tensor is never
materialised). Both skip key blocks causally past their queries, and the top-k skips the same blocks, so a step
costs what its live history costs, not the capacity. Indexer keys may be stored in FP8 (``quantize_index_keys``)
and scored at three precisions (``PRECISIONS``).

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
     builds the 16 candidate thresholds (the digits found so far plus one more) and counts per block how many
     keys are >= each; one XLA fusion sums the blocks and keeps the pass's digit: the largest candidate with
     count >= k. After 32 bits the threshold is exactly the k-th largest key.
  2. ``_tie_count_kernel``: per block, keys > threshold and keys == threshold.
  3. ``_compact_kernel``: each program takes from every block's tie counts its block's share of the ties (lowest
     positions first) and output offset, ranks its selected lanes with a cumsum and scatters their positions
     (masked store) into the output row, which is therefore written in ascending position order without sorting.
Between the kernels, the blocks' counts are summed either by XLA (``block_totals="xla"``: per pass a kernel and one
small fusion; 18 launches a call) or in place by the kernels themselves with integer atomic adds (``"atomic"``:
each kernel derives its candidates, the threshold and its block's offsets from the totals; one launch per pass).
Each launch costs ~1-3 us of a decode step however little it does (a batch-1 step at 8K ran 493 kernels under
5 us, 861 us of its 3.45 ms: ``experiments/results/profile_decode_8k_model_50c9f4d.json``), so the candidates, the
threshold and the blocks' offsets are computed inside the kernels from the passes' digits, not in fusions of their
own (28 launches a call before; 27 while the prefix was assembled between the passes, where XLA ran the shift and
OR as a fusion apart from the digit's reduction: ``probes/profile_decode_8k_model_40ed69c.json``; 26 with the
digit's ``- 1`` left between them, ``probes/profile_decode_8k_model_c993172.json``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas.hot_gather import triton_misaddressed
from kernels_pallas.kv_formats import from_stored, stored_dtype

_RADIX_BITS = 4
_RADIX = 1 << _RADIX_BITS  # 16 candidate thresholds per pass.
_NUM_PASSES = 32 // _RADIX_BITS
_INT_MIN = np.int32(-(2**31))  # the sign bit: u = key ^ _INT_MIN orders keys as unsigned integers (held in int32)


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

PRECISIONS = ("highest", "bf16", "fp8")
FP8_MAX = 448.0  # largest finite float8_e4m3fn
KEY_FORMATS = ("model", "fp8")
MAX_DECODE_QUERIES = 8  # query rows per lane up to which the per-token (decode / verify) kernel runs
CHUNK_QUERIES = 64  # query rows per program of the chunk (prefill / append) kernel


def quantize_index_keys(keys: jax.Array) -> tuple[jax.Array, jax.Array]:
    """FP8 indexer keys, as DeepSeek-V3.2's indexer cache holds them: e4m3 with one f32 scale per key
    (``amax / 448``), 132 bytes per key at D = 128 instead of 256 in bf16. ``keys [..., D]`` ->
    ``(float8_e4m3fn [..., D], f32 [...])``; ``dequantize_index_keys`` inverts it up to e4m3 rounding
    (relative error <= 2**-4 per element above e4m3's normal range, absolute <= 2**-10 * scale below it)."""
    kf = keys.astype(jnp.float32)
    amax = jnp.max(jnp.abs(kf), axis=-1)
    # Floored at f32's smallest normal: for keys below ~5e-36 amax / 448 is subnormal, which CPUs flush to zero
    # (keys / 0: NaN keys; found by test_fp8_key_error_bound).
    scale = jnp.where(amax > 0, jnp.maximum(amax / FP8_MAX, np.finfo(np.float32).tiny), 1.0).astype(jnp.float32)
    # Clipped: amax / (amax / 448) may round just above 448, which e4m3fn (no infinities) would turn into NaN.
    return jnp.clip(kf / scale[..., None], -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn), scale


def dequantize_index_keys(keys: jax.Array, scale: jax.Array) -> jax.Array:
    return keys.astype(jnp.float32) * scale[..., None]


def _key_values(keys: jax.Array, key_dtype) -> jax.Array:
    """The keys' values: ``keys`` themselves, or the ``key_dtype`` values whose bits they store (a cache stores
    bf16 and fp8 keys as unsigned integers: kernels_pallas.kv_formats, "stored")."""
    return keys if keys.dtype == key_dtype else from_stored(keys, key_dtype)


def _prepare_queries(q, weights, key_dtype, precision: str):
    """Cast the queries for ``precision`` (outside the kernels, so kernel and reference see the same values) and
    choose the dtype of the kernels' dot.

    * ``highest``: the query as it is; products in f32. A bf16 query against bf16 or fp8 keys goes through a bf16
      dot with f32 accumulation, which is exact (bf16 x bf16 and bf16 x e4m3 products fit f32's mantissa) and runs
      on tensor cores (the f32 IEEE dot was ~10x slower on an H200); anything else is an f32 dot at HIGHEST
      precision (the Triton lowering otherwise uses tf32).
    * ``bf16``: query and keys rounded to bf16, bf16 dot with f32 accumulation.
    * ``fp8``: fp8 keys only; the query is quantised to e4m3 with one scale per (token, head), folded into the
      head weight (relu(a x) = a relu(x) for a > 0), like DeepSeek-V3.2's fp8 indexer. e4m3 x e4m3 products are
      exact in f32, so the dot runs in bf16 (exact) here; an fp8 tensor-core dot would compute the same products.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"indexer precision must be one of {PRECISIONS}, got {precision!r}")
    fp8_keys = key_dtype == jnp.float8_e4m3fn
    weights = weights.astype(jnp.float32)
    if precision == "fp8":
        if not fp8_keys:
            raise ValueError(f"indexer precision 'fp8' needs fp8 index keys, got {key_dtype} keys")
        q8, q_scale = quantize_index_keys(q)
        # The barrier keeps the e4m3 rounding: XLA's GPU pipeline otherwise folds convert(convert(q, f8), bf16)
        # into convert(q, bf16) (excess precision is allowed by default), and kernel and reference, folded
        # differently, disagreed on the H200. Stored fp8 keys are unaffected (they are materialised as e4m3).
        # Handed to the kernels as bf16, exactly the e4m3 values: the products are the same as an fp8 dot's.
        return lax.optimization_barrier(q8).astype(jnp.bfloat16), weights * q_scale, jnp.bfloat16
    if precision == "bf16":
        return q.astype(jnp.bfloat16), weights, jnp.bfloat16
    narrow = q.dtype == jnp.bfloat16 and (key_dtype == jnp.bfloat16 or fp8_keys)
    return q, weights, (jnp.bfloat16 if narrow else jnp.float32)


def _dot_precision(dot_dtype):
    return lax.Precision.DEFAULT if dot_dtype == jnp.bfloat16 else lax.Precision.HIGHEST


def _indexer_scores_decode_kernel(
    q_ref,  # [T, Hi, D] (lane squeezed)
    w_ref,  # [T, Hi] f32
    qpos_ref,  # [T] int32
    plane_ref,  # [S] int32, ANY: the key plane of each lane
    k_ref,  # [P, N, D] key_dtype values or their bits, ANY: every plane's keys, read in place
    *rest,  # (ks_ref [P, N] f32, ANY: fp8 key scales)?, o_ref [T, block_keys] f32
    softmax_scale: float,
    block_keys: int,
    dot_dtype,
    key_dtype,
):
    ks_ref, o_ref = (rest[0], rest[1]) if len(rest) == 2 else (None, rest[0])
    # program_id is read outside pl.when: the interpreter cannot evaluate it inside a branch.
    lane, j = pl.program_id(0), pl.program_id(1)
    start = j * block_keys
    qpos = qpos_ref[...]
    # Key blocks past every query of the lane are all causally masked: skipping them makes a decode step's cost
    # follow the live history, not the capacity (a 10K session in a 1M-row cache scores 10K keys).
    live = start <= jnp.max(qpos)

    @pl.when(live)
    def _():
        # The plane is read from a ref (Pallas' Triton lowering has no scalar prefetch), and the key block loaded
        # from the whole keys array: a blocked spec needs its block index before the kernel runs, and a gathered
        # [S, N, D] operand would copy every lane's keys per layer and step.
        plane = plane_ref[lane]
        keys = _key_values(k_ref[plane, pl.ds(start, block_keys), :], key_dtype).astype(dot_dtype)  # [block_keys, D]
        n = start + lax.broadcasted_iota(jnp.int32, (block_keys,), 0)
        key_scale = None if ks_ref is None else ks_ref[plane, pl.ds(start, block_keys)]
        # One [Hi, D] x [D, block_keys] dot per query token: T is small here (1, or a few MTP drafts) and a
        # per-token dot needs no in-kernel reshape.
        for t in range(q_ref.shape[0]):
            logits = lax.dot_general(q_ref[t].astype(dot_dtype), keys, (((1,), (1,)), ((), ())),
                                     precision=_dot_precision(dot_dtype),
                                     preferred_element_type=jnp.float32)  # [Hi, block_keys]
            act = jnp.maximum(logits * softmax_scale, 0.0)
            score = jnp.sum(act * w_ref[t][:, None], axis=0)
            if key_scale is not None:
                score = score * key_scale
            o_ref[t] = jnp.where(n > qpos_ref[t], -jnp.inf, score)  # a ref load: Triton has no value slice

    @pl.when(jnp.logical_not(live))
    def _():
        o_ref[...] = jnp.full(o_ref.shape, -jnp.inf, jnp.float32)


def _indexer_scores_chunk_kernel(
    q_ref,  # [Hi, Tq, D] (lane squeezed): head-major, so one head's queries are one leading-index load
    w_ref,  # [Hi, Tq] f32
    qpos_ref,  # [Tq] int32
    plane_ref,  # [S] int32, ANY
    k_ref,  # [P, N, D], ANY
    *rest,  # (ks_ref [P, N] f32, ANY)?, o_ref [Tq, block_keys] f32
    softmax_scale: float,
    block_keys: int,
    dot_dtype,
    key_dtype,
):
    ks_ref, o_ref = (rest[0], rest[1]) if len(rest) == 2 else (None, rest[0])
    lane, j = pl.program_id(0), pl.program_id(2)
    start = j * block_keys
    qpos = qpos_ref[...]
    live = start <= jnp.max(qpos)  # causal: about half of a prefill's blocks are skipped

    @pl.when(live)
    def _():
        plane = plane_ref[lane]
        keys = _key_values(k_ref[plane, pl.ds(start, block_keys), :], key_dtype).astype(dot_dtype)  # [block_keys, D]

        # A chunk of queries against a block of keys, one head at a time, accumulating the weighted ReLU: the
        # per-head [T, heads, N] tensor never exists (at a 1M-token history it would be ~134 GB per chunk).
        def head(h, acc):
            logits = lax.dot_general(q_ref[h].astype(dot_dtype), keys, (((1,), (1,)), ((), ())),
                                     precision=_dot_precision(dot_dtype),
                                     preferred_element_type=jnp.float32)  # [Tq, block_keys]
            return acc + jnp.maximum(logits * softmax_scale, 0.0) * w_ref[h][:, None]

        acc = lax.fori_loop(0, q_ref.shape[0], head, jnp.zeros(o_ref.shape, jnp.float32))
        if ks_ref is not None:
            acc = acc * ks_ref[plane, pl.ds(start, block_keys)][None, :]
        n = start + lax.broadcasted_iota(jnp.int32, (block_keys,), 0)
        o_ref[...] = jnp.where(n[None, :] > qpos[:, None], -jnp.inf, acc)

    @pl.when(jnp.logical_not(live))
    def _():
        o_ref[...] = jnp.full(o_ref.shape, -jnp.inf, jnp.float32)


def _validate_scores(q, weights, keys, key_plane, query_positions, key_scale, key_dtype):
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
    if not jnp.issubdtype(query_positions.dtype, jnp.integer):  # the kernels truncate, the reference would not
        raise ValueError(f"query_positions must be an integer array, got {query_positions.dtype}")
    if not jnp.issubdtype(key_dtype, jnp.floating):  # integer "keys" would be scored as numbers
        raise ValueError(f"indexer keys of {keys.dtype} are not float values: bits of bf16 or fp8 keys "
                         "(kernels_pallas.kv_formats.stored_dtype) need the key_dtype they store")
    if keys.dtype not in (key_dtype, stored_dtype(key_dtype)):
        raise ValueError(f"keys of {keys.dtype} are neither {key_dtype} values nor their bits "
                         f"({stored_dtype(key_dtype)})")
    fp8 = key_dtype == jnp.float8_e4m3fn
    if fp8 != (key_scale is not None):
        raise ValueError("fp8 keys need their key_scale [P, N] (and only fp8 keys have one); got "
                         f"{key_dtype} keys and key_scale {None if key_scale is None else key_scale.shape}")
    if key_scale is not None and key_scale.shape != keys.shape[:2]:
        raise ValueError(f"key_scale must be [P, N] = {keys.shape[:2]}, got {key_scale.shape}")


def _pad_axis1(x, n: int):
    return x if x.shape[1] == n else jnp.pad(x, [(0, 0), (0, n - x.shape[1])] + [(0, 0)] * (x.ndim - 2))


@functools.partial(jax.jit, static_argnames=("softmax_scale", "precision", "block_keys", "interpret", "key_dtype"))
def indexer_scores(
    q: jax.Array,
    weights: jax.Array,
    keys: jax.Array,
    key_plane: jax.Array,
    query_positions: jax.Array,
    key_scale: jax.Array | None = None,
    *,
    softmax_scale: float,
    precision: str = "highest",
    block_keys: int = 128,
    interpret: bool = False,
    key_dtype=None,
) -> jax.Array:
    """DSA indexer scores f32[S, T, N].

    ``score[s,t,n] = key_scale[p,n] * sum_h weights[s,t,h] * relu(q[s,t,h] . keys[p,n] * softmax_scale)`` with
    ``p = key_plane[s]`` (``key_scale`` = 1 for keys in the model dtype), computed in f32 at ``precision`` (see
    ``_prepare_queries``), and -inf where ``n > query_positions[s,t]``. Products are exact f32; only the
    summation order differs from the reference.

    Up to ``MAX_DECODE_QUERIES`` query rows per lane (decode, MTP verify) run one dot per token over all heads;
    longer chunks (prefill, append) run ``CHUNK_QUERIES`` queries per program, one head at a time. Both skip key
    blocks past every query of their program, so the cost follows the live history, not N.

    Args:
      q: [S, T, Hi, D] (bf16 or f32); Hi and D powers of two.
      weights: [S, T, Hi] f32 per-head weights.
      keys: [P, N, D] indexer keys of every plane (layer and session slot), read in place; N a multiple of
        ``block_keys``. Model dtype, or float8_e4m3fn with ``key_scale`` (``quantize_index_keys``); compiled,
        FP8 keys of 2**31..2**32 elements are refused (misaddressed by the Triton lowering, see the check below).
      key_plane: int32[S], the plane of ``keys`` lane s scores against, in [0, P) (otherwise undefined: the
        kernel reads outside ``keys``, the reference other keys or NaN).
      query_positions: int32[S, T] absolute position of each query token; keys past it score -inf (all of them
        for a negative position).
      key_scale: f32[P, N], fp8 keys' scales; None for keys in the model dtype.
      key_dtype: the dtype of the keys' values when ``keys`` holds their bits (``kv_formats.stored_dtype``, as the
        caches store bf16 and fp8 keys); None: ``keys`` are the values.
      softmax_scale: scale applied to the logits before the relu.
      precision: "highest" | "bf16" | "fp8" (``PRECISIONS``).
      block_keys: keys per program (power of two).
      interpret: run the Pallas interpreter (CPU tests).
    """
    key_dtype = keys.dtype if key_dtype is None else np.dtype(key_dtype)
    _validate_scores(q, weights, keys, key_plane, query_positions, key_scale, key_dtype)
    S, T, Hi, D = q.shape
    N = keys.shape[1]
    if not _is_pow2(block_keys):
        raise ValueError(f"block_keys must be a power of two, got {block_keys}")
    if N % block_keys:
        raise ValueError(f"N={N} keys must be a multiple of block_keys={block_keys}")
    if not (_is_pow2(Hi) and _is_pow2(D)):
        raise ValueError(f"Hi={Hi} and D={D} must be powers of two (Triton tiles)")
    # The keys are read in place (memory_space=ANY), so the lowering's offsets are the whole array's: FP8 keys of
    # 2**31..2**32 elements (e.g. 144 planes x 200K positions x 128) get 32-bit offsets past 2**31, negative, and
    # would read other keys or fault (kernels_pallas.hot_gather: addressing; checked by lowering for CUDA).
    if not interpret and triton_misaddressed(keys.shape, keys.dtype):
        raise ValueError(f"indexer keys {keys.dtype}{list(keys.shape)}: {keys.size:,} elements (2**31 or more) in at most "
                         "2**32 bytes, which Pallas' Triton lowering addresses with negative 32-bit offsets; "
                         "allocate padding planes past 2**32 bytes (glm53.cache.index_key_shapes does) or keep "
                         "the keys in the model dtype")
    if S * N == 0:  # a grid of zero programs does not lower
        return jnp.zeros((S, T, N), jnp.float32)
    q, weights, dot_dtype = _prepare_queries(q, weights, key_dtype, precision)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    scale_ops = [] if key_scale is None else [key_scale.astype(jnp.float32)]
    scale_specs = [any_spec] * len(scale_ops)
    common = dict(softmax_scale=float(softmax_scale), block_keys=block_keys, dot_dtype=dot_dtype, key_dtype=key_dtype)
    # Padded query rows (position 0, zero weights) are sliced off.
    if T <= MAX_DECODE_QUERIES:
        Tp = _next_pow2(T)
        q, weights, query_positions = (_pad_axis1(x, Tp) for x in (q, weights, query_positions))
        out = pl.pallas_call(
            functools.partial(_indexer_scores_decode_kernel, **common),
            grid=(S, N // block_keys),
            in_specs=[
                pl.BlockSpec((None, Tp, Hi, D), lambda s, j: (s, 0, 0, 0)),
                pl.BlockSpec((None, Tp, Hi), lambda s, j: (s, 0, 0)),
                pl.BlockSpec((None, Tp), lambda s, j: (s, 0)),
                any_spec,
                any_spec,
                *scale_specs,
            ],
            out_specs=pl.BlockSpec((None, Tp, block_keys), lambda s, j: (s, 0, j)),
            out_shape=jax.ShapeDtypeStruct((S, Tp, N), jnp.float32),
            compiler_params=_compiler_params(num_stages=2),
            interpret=interpret,
            name="indexer_scores",
        )(q, weights, query_positions.astype(jnp.int32), key_plane.astype(jnp.int32), keys, *scale_ops)
        return out[:, :T]
    Tq = min(CHUNK_QUERIES, _next_pow2(T))  # >= 16 here: Triton's smallest dot
    Tp = -(-T // Tq) * Tq
    q, weights, query_positions = (_pad_axis1(x, Tp) for x in (q, weights, query_positions))
    out = pl.pallas_call(
        functools.partial(_indexer_scores_chunk_kernel, **common),
        grid=(S, Tp // Tq, N // block_keys),
        in_specs=[
            pl.BlockSpec((None, Hi, Tq, D), lambda s, i, j: (s, 0, i, 0)),
            pl.BlockSpec((None, Hi, Tq), lambda s, i, j: (s, 0, i)),
            pl.BlockSpec((None, Tq), lambda s, i, j: (s, i)),
            any_spec,
            any_spec,
            *scale_specs,
        ],
        out_specs=pl.BlockSpec((None, Tq, block_keys), lambda s, i, j: (s, i, j)),
        out_shape=jax.ShapeDtypeStruct((S, Tp, N), jnp.float32),
        compiler_params=_compiler_params(num_stages=2),
        interpret=interpret,
        name="indexer_scores_chunk",
    )(q.transpose(0, 2, 1, 3), weights.transpose(0, 2, 1), query_positions.astype(jnp.int32),
      key_plane.astype(jnp.int32), keys, *scale_ops)
    return out[:, :T]


@functools.partial(jax.jit, static_argnames=("softmax_scale", "precision", "block_keys", "interpret", "key_dtype"))
def indexer_scores_reference(
    q: jax.Array,
    weights: jax.Array,
    keys: jax.Array,
    key_plane: jax.Array,
    query_positions: jax.Array,
    key_scale: jax.Array | None = None,
    *,
    softmax_scale: float,
    precision: str = "highest",
    block_keys: int = 128,
    interpret: bool = False,
    key_dtype=None,
) -> jax.Array:
    """Pure-jnp ``indexer_scores`` (same signature; block_keys/interpret unused). One head at a time, so memory
    stays at the [S, T, N] result (never the per-head tensor)."""
    del block_keys, interpret
    key_dtype = keys.dtype if key_dtype is None else np.dtype(key_dtype)
    _validate_scores(q, weights, keys, key_plane, query_positions, key_scale, key_dtype)
    q, weights, dot_dtype = _prepare_queries(q, weights, key_dtype, precision)
    plane = key_plane.astype(jnp.int32)
    # Each lane's plane taken first, then its bits read as values: only the lanes' planes, never all of them.
    k = _key_values(jnp.take(keys, plane, axis=0), key_dtype).astype(dot_dtype).astype(jnp.float32)  # [S, N, D]
    qf = q.astype(dot_dtype).astype(jnp.float32)

    def head(h, acc):
        logits = jnp.einsum("std,snd->stn", qf[:, :, h], k, precision=lax.Precision.HIGHEST,
                            preferred_element_type=jnp.float32)
        return acc + jnp.maximum(logits * softmax_scale, 0.0) * weights[:, :, h, None]

    S, T, Hi, _ = q.shape
    score = lax.fori_loop(0, Hi, head, jnp.zeros((S, T, keys.shape[1]), jnp.float32))
    if key_scale is not None:
        score = score * jnp.take(key_scale.astype(jnp.float32), plane, axis=0)[:, None, :]
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


def _radix_count_kernel(x_ref, len_ref, *refs, block_n: int, p: int):
    """Pass ``p``: per candidate threshold (the digits of the passes before plus one more), how many keys of the
    block are >= it.

    refs: the digits the passes before kept (``p`` refs of [1] int32, each the digit + 1, most significant first),
    then the output [16] int32. The kernel assembles the prefix and the candidates itself: in XLA each was a small
    fusion of its own per pass (an OR and a shift after the digit's reduction, which XLA did not fuse into it). Each
    pass compiles a kernel of its own (``p`` is static)."""
    digit_refs, o_ref = refs[:-1], refs[-1]
    start = pl.program_id(1) * block_n
    live = start < len_ref[0]

    @pl.when(live)
    def _():
        prefix = _prefix_of_digits(digit_refs)
        digits = lax.broadcasted_iota(jnp.int32, (_RADIX,), 0)
        cand = (prefix | (digits << (32 - _RADIX_BITS * (p + 1)))) ^ _INT_MIN  # signed key domain
        n = start + lax.broadcasted_iota(jnp.int32, (block_n,), 0)
        key = _sortable_key(x_ref[...])
        ge = (key[None, :] >= cand[:, None]) & (n < len_ref[0])[None, :]  # [16, block_n]
        o_ref[...] = jnp.sum(ge.astype(jnp.int32), axis=1)

    @pl.when(jnp.logical_not(live))
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, jnp.int32)


def _prefix_of_digits(digit_refs):
    """The threshold's leading ``4 * len(digit_refs)`` bits (unsigned domain, held in an int32) from the passes'
    results, most significant first. Each pass hands over how many of its candidates have >= k keys at or above
    them (>= 1); its digit is one less. The kernels subtract: XLA ran the ``- 1`` as a fusion apart from the
    reduction that counts (32 launches a batch-1 step, ``probes/profile_decode_8k_model_c993172.json``)."""
    return _prefix_of([ref[0] for ref in digit_refs])


def _prefix_of(candidates_at_least_k):
    """The prefix from each pass's count of candidates with >= k keys at or above them (the digit + 1)."""
    prefix = jnp.int32(0)
    for q, n in enumerate(candidates_at_least_k):
        prefix = prefix | ((n - 1) << (32 - _RADIX_BITS * (q + 1)))
    return prefix


def _tie_count_kernel(x_ref, len_ref, *refs, block_n: int):
    """refs: the 8 passes' digits + 1 ([1] int32 each: the row's threshold key), then gt [1] (keys > threshold in the
    block) and eq [1] (keys == threshold)."""
    digit_refs, (gt_ref, eq_ref) = refs[:-2], refs[-2:]
    _tie_count_block(x_ref, len_ref, _prefix_of_digits(digit_refs) ^ _INT_MIN, gt_ref, eq_ref, block_n)


def _tie_count_block(x_ref, len_ref, thr, gt_ref, eq_ref, block_n: int):
    start = pl.program_id(1) * block_n
    live = start < len_ref[0]

    @pl.when(live)
    def _():
        n = start + lax.broadcasted_iota(jnp.int32, (block_n,), 0)
        key = _sortable_key(x_ref[...])
        inside = n < len_ref[0]
        gt_ref[0] = jnp.sum(((key > thr) & inside).astype(jnp.int32))
        eq_ref[0] = jnp.sum(((key == thr) & inside).astype(jnp.int32))

    @pl.when(jnp.logical_not(live))
    def _():
        gt_ref[0] = jnp.int32(0)
        eq_ref[0] = jnp.int32(0)


def _compact_kernel(x_ref, len_ref, *refs, block_n: int, nb: int, k: int):
    """refs: the 8 passes' digits + 1 ([1] int32 each: the row's threshold key); gt and eq, [R, next_pow2(nb)] int32
    per block: keys > and == the threshold (ANY; the first nb written); the output [R, k] int32 selected
    positions (ANY, scattered into)."""
    digit_refs, (gt_ref, eq_ref, o_ref) = refs[:-3], refs[-3:]
    r = pl.program_id(0)
    b = pl.program_id(1)

    @pl.when(b * block_n < len_ref[0])
    def _():
        need_eq, eq_before, out_off = _block_offsets(gt_ref, eq_ref, r, b, nb, k)
        _compact_block(x_ref, len_ref[0], _prefix_of_digits(digit_refs) ^ _INT_MIN, need_eq, eq_before, out_off,
                       o_ref, r, b, block_n)


def _block_offsets(gt_ref, eq_ref, r, b, nb: int, k: int):
    """From every block's ``gt`` / ``eq`` counts of row ``r``: the ties at the threshold the row still takes, the
    ties in blocks before ``b`` and block ``b``'s first output slot. Each program derives them from the row's few
    counts (about 1,000 blocks at a million positions) instead of XLA computing them in two fusions between kernels."""
    width = _next_pow2(nb)
    blk = lax.broadcasted_iota(jnp.int32, (width,), 0)
    written = blk < nb
    gt = plgpu.load(gt_ref.at[r, pl.ds(0, width)], mask=written, other=0)
    eq = plgpu.load(eq_ref.at[r, pl.ds(0, width)], mask=written, other=0)
    need_eq = k - jnp.sum(gt)  # >= 1
    eq_before_all = jnp.cumsum(eq) - eq
    taken = gt + jnp.clip(need_eq - eq_before_all, 0, eq)
    out_off_all = jnp.cumsum(taken) - taken
    mine = blk == b
    return need_eq, jnp.sum(jnp.where(mine, eq_before_all, 0)), jnp.sum(jnp.where(mine, out_off_all, 0))


def _compact_block(x_ref, row_len, thr, need_eq, eq_before, out_off, o_ref, r, b, block_n: int):
    n = b * block_n + lax.broadcasted_iota(jnp.int32, (block_n,), 0)
    key = _sortable_key(x_ref[...])
    inside = n < row_len
    is_eq = ((key == thr) & inside).astype(jnp.int32)
    # Ties are taken lowest position first: a tie's global rank among ties decides.
    eq_rank = eq_before + jnp.cumsum(is_eq) - is_eq
    sel = ((key > thr) & inside) | ((is_eq == 1) & (eq_rank < need_eq))
    sel_i = sel.astype(jnp.int32)
    dest = out_off + jnp.cumsum(sel_i) - sel_i  # [block_n]
    # Blocks own disjoint, contiguous slot ranges, so the scatter has no conflicts.
    plgpu.store(o_ref.at[r, dest], n, mask=sel)


def _prefix_from_totals(tot_ref, r, passes: int, k: int):
    """The threshold's leading ``4 * passes`` bits (unsigned domain, held in an int32) from the row's candidate
    totals of the passes done: each pass keeps the largest digit whose candidate still has >= k keys at or above."""
    totals = [plgpu.load(tot_ref.at[r, jnp.int32(q), pl.ds(0, _RADIX)]) for q in range(passes)]  # non-increasing
    return _prefix_of([jnp.sum((total >= k).astype(jnp.int32)) for total in totals])


def _radix_count_atomic_kernel(
    x_ref,  # [block_n] f32 scores
    len_ref,  # [1] int32 selectable positions of the row
    tot_in_ref,  # aliased with tot_ref
    tot_ref,  # [R, passes, 16] int32 per row, pass and candidate: keys >= it, summed over blocks (ANY)
    *,
    block_n: int,
    p: int,
    k: int,
):
    """Pass ``p`` of the radix select with the blocks' counts summed in place: every program reads the totals of
    the passes before (so it derives this pass's candidates itself) and adds its own counts to this pass's row with
    an integer atomic add. Integer sums do not depend on the order the programs add in, so the result is exact.

    One scalar atomic per candidate, not one over the 16-vector: JAX's Triton lowering (0.10-0.11) picks the atomic's
    op from the value's type and does not recognise a tensor of int32 as integer, so a vector add became a *float*
    add on the integers' bits (``tt.atomic_rmw fadd``). Small counts are then float denormals, which the GPU flushes
    to zero in some compiles: on the H200 the totals came back zero (8 of 9 compiled top-k tests failed at 7156d33).
    ``tests/test_kernels_lower.py`` checks the lowered op is an integer add."""
    del tot_in_ref
    r = pl.program_id(0)
    start = pl.program_id(1) * block_n

    @pl.when(start < len_ref[0])
    def _():
        shift = 32 - _RADIX_BITS * (p + 1)
        prefix = _prefix_from_totals(tot_ref, r, p, k)
        n = start + lax.broadcasted_iota(jnp.int32, (block_n,), 0)
        key = _sortable_key(x_ref[...])
        inside = n < len_ref[0]
        for d in range(_RADIX):
            digit_bits = np.uint32(d << shift).view(np.int32)  # the digit in place, as int32 bits
            cand = (prefix | digit_bits) ^ _INT_MIN  # signed key domain
            count = jnp.sum(((key >= cand) & inside).astype(jnp.int32))
            plgpu.atomic_add(tot_ref, (r, jnp.int32(p), jnp.int32(d)), count)


def _tie_count_atomic_kernel(x_ref, len_ref, tot_ref, gt_ref, eq_ref, *, block_n: int, k: int):
    """``_tie_count_kernel`` with the threshold read from the passes' totals (``tot_ref``, ANY)."""
    thr = _prefix_from_totals(tot_ref, pl.program_id(0), _NUM_PASSES, k) ^ _INT_MIN
    _tie_count_block(x_ref, len_ref, thr, gt_ref, eq_ref, block_n)


def _compact_atomic_kernel(x_ref, len_ref, tot_ref, gt_ref, eq_ref, o_ref, *, block_n: int, nb: int, k: int):
    """``_compact_kernel`` with the threshold read from the totals."""
    r = pl.program_id(0)
    b = pl.program_id(1)

    @pl.when(b * block_n < len_ref[0])
    def _():
        thr = _prefix_from_totals(tot_ref, r, _NUM_PASSES, k) ^ _INT_MIN
        need_eq, eq_before, out_off = _block_offsets(gt_ref, eq_ref, r, b, nb, k)
        _compact_block(x_ref, len_ref[0], thr, need_eq, eq_before, out_off, o_ref, r, b, block_n)


def _row_block_spec(block_n: int):
    return pl.BlockSpec((None, block_n), lambda r, b: (r, b))


def _per_row_spec():
    return pl.BlockSpec((None, 1), lambda r, b: (r, 0))


def _per_block_spec():
    return pl.BlockSpec((None, 1), lambda r, b: (r, b))


def selectable_positions(query_positions: jax.Array, k: int, N: int) -> jax.Array:
    """int32[...]: how many leading positions of each row can be selected. Positions past the query are -inf and
    taken only to fill a row with fewer than k finite scores, lowest first, so every selected position lies below
    ``max(query_position + 1, k)``; cutting the row there changes nothing and lets the kernels skip the rest."""
    return jnp.clip(jnp.maximum(query_positions.astype(jnp.int32) + 1, k), 1, N)


BLOCK_TOTALS = ("xla", "atomic")


def _check_k(k, N: int) -> None:
    # k is static and sizes the output: a float k failed deep in shape checks
    if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or not 1 <= k <= N:
        raise ValueError(f"k={k!r} must be an int in [1, N={N}]")


@functools.partial(jax.jit, static_argnames=("k", "block_n", "block_totals", "interpret"))
def topk_positions(
    scores: jax.Array,
    k: int,
    query_positions: jax.Array | None = None,
    *,
    block_n: int = 1024,
    block_totals: str = "xla",
    interpret: bool = False,
) -> jax.Array:
    """Positions of the k highest scores per row, ascending (see module rule).

    Args:
      scores: f32[S, T, N].
      k: number of positions per row, 1 <= k <= N.
      query_positions: int32[S, T], optional: the query position of each row, whose scores past it must be -inf
        (causal, as ``indexer_scores`` gives them). Blocks past ``selectable_positions`` are then never read, so
        the cost follows the live history, not N; the result is the same. A finite score past its row's query
        position may not be selected (the reference, which ignores ``query_positions``, would select it).
      block_n: scores per program (power of two); N is padded with -inf to a
        multiple of min(block_n, next_pow2(N)). Padding sits above every real
        position, so it is never chosen over a real -inf.
      block_totals: how the blocks' counts reach the next kernel. ``"xla"``: XLA sums them between the kernels
        (per radix pass a kernel and one small XLA fusion). ``"atomic"``: the kernels add them up in place with
        integer atomic adds and derive each pass's candidates, the threshold and each block's output offset
        themselves (one kernel per pass, no XLA work between them: 10 launches instead of 18 per call). Both
        select the same positions. ``"atomic"`` measured slower in the model on the H200 (batch-1 decode at 8K
        279.4 against 296.8 tok/s, prefill 154K against 242K tok/s:
        ``experiments/results/generate_8k_topk_ab_50c9f4d.json``), so the model keeps ``"xla"``.
      interpret: run the Pallas interpreter (CPU tests).

    Returns:
      int32[S, T, k] (empty for S or T = 0).
    """
    if scores.ndim != 3:  # unpacked below: "not enough values to unpack" named neither the array nor its rank
        raise ValueError(f"scores must be [S, T, N], got shape {scores.shape}")
    S, T, N = scores.shape
    _check_k(k, N)
    if not _is_pow2(block_n):
        raise ValueError(f"block_n must be a power of two, got {block_n}")
    if block_totals not in BLOCK_TOTALS:
        raise ValueError(f"block_totals must be one of {BLOCK_TOTALS}, got {block_totals!r}")
    if query_positions is not None and query_positions.shape != (S, T):
        raise ValueError(f"query_positions must be [S, T] = {(S, T)}, got {query_positions.shape}")
    R = S * T
    if R == 0:  # a grid of zero programs does not lower
        return jnp.zeros((S, T, k), jnp.int32)
    block_n = min(block_n, _next_pow2(N))
    nb = -(-N // block_n)
    x = scores.astype(jnp.float32).reshape(R, N)
    if nb * block_n != N:
        x = jnp.pad(x, [(0, 0), (0, nb * block_n - N)], constant_values=-jnp.inf)
    if query_positions is None:
        row_len = jnp.full((R, 1), N, jnp.int32)
    else:
        row_len = selectable_positions(query_positions, k, N).reshape(R, 1)
    grid = (R, nb)
    common = dict(grid=grid, interpret=interpret)
    if block_totals == "atomic":
        return _topk_positions_atomic(x, row_len, k, block_n, nb, common).reshape(S, T, k)

    row, per_row = _row_block_spec(block_n), _per_row_spec()

    # Threshold search in the unsigned domain u = key ^ _INT_MIN (held in int32), where candidates are the digits
    # found so far plus one more; invariant: count(keys >= prefix) >= k. Between two passes' kernels XLA runs one
    # fusion: the blocks' counts summed and the pass's digit kept. Each kernel takes the digits as they are
    # ([R, 1] each) and assembles the prefix itself.
    # Unrolled: XLA's GPU runtime launches the kernels of a while loop one by one, outside the command buffers
    # (CUDA graphs) that carry the rest of the step, so a rolled loop cost 6 host launches x 8 passes per indexer
    # layer per decode step, and batch-1 decode was bound by how fast the host could launch (measured with
    # experiments.profile_decode: 192 lone launches per step).
    digits = []
    for p in range(_NUM_PASSES):
        block_counts = pl.pallas_call(
            functools.partial(_radix_count_kernel, block_n=block_n, p=p),
            in_specs=[row, per_row] + [per_row] * p,
            out_specs=pl.BlockSpec((None, None, _RADIX), lambda r, b: (r, b, 0)),
            out_shape=jax.ShapeDtypeStruct((R, nb, _RADIX), jnp.int32),
            compiler_params=_compiler_params(num_stages=1),
            name="topk_radix_count",
            **common,
        )(x, row_len, *digits)
        counts = block_counts.sum(axis=1)  # [R, 16], non-increasing in the digit
        digits.append(jnp.sum(counts >= k, axis=1, keepdims=True, dtype=jnp.int32))  # the digit + 1

    width = _next_pow2(nb)  # the compact kernel loads every block's counts as one power-of-two vector
    gt, eq = pl.pallas_call(
        functools.partial(_tie_count_kernel, block_n=block_n),
        in_specs=[row, per_row] + [per_row] * _NUM_PASSES,
        out_specs=[_per_block_spec(), _per_block_spec()],
        out_shape=[jax.ShapeDtypeStruct((R, width), jnp.int32)] * 2,
        compiler_params=_compiler_params(num_stages=1),
        name="topk_tie_count",
        **common,
    )(x, row_len, *digits)

    any_space = pl.BlockSpec(memory_space=pl.ANY)
    out = pl.pallas_call(
        functools.partial(_compact_kernel, block_n=block_n, nb=nb, k=k),
        in_specs=[row, per_row] + [per_row] * _NUM_PASSES + [any_space, any_space],
        out_specs=any_space,
        out_shape=jax.ShapeDtypeStruct((R, k), jnp.int32),
        compiler_params=_compiler_params(num_stages=1),
        name="topk_compact",
        **common,
    )(x, row_len, *digits, gt, eq)
    return out.reshape(S, T, k)


def _topk_positions_atomic(x, row_len, k: int, block_n: int, nb: int, common: dict) -> jax.Array:
    """``topk_positions`` with ``block_totals="atomic"``: x f32[R, nb * block_n], row_len int32[R, 1]."""
    R = x.shape[0]
    row, per_row = _row_block_spec(block_n), _per_row_spec()
    any_space = pl.BlockSpec(memory_space=pl.ANY)
    totals = jnp.zeros((R, _NUM_PASSES, _RADIX), jnp.int32)
    for p in range(_NUM_PASSES):
        totals = pl.pallas_call(
            functools.partial(_radix_count_atomic_kernel, block_n=block_n, p=p, k=k),
            in_specs=[row, per_row, any_space],
            out_specs=any_space,
            out_shape=jax.ShapeDtypeStruct(totals.shape, jnp.int32),
            input_output_aliases={2: 0},
            compiler_params=_compiler_params(num_stages=1),
            name=f"topk_radix_count_atomic_{p}",
            **common,
        )(x, row_len, totals)
    width = _next_pow2(nb)
    gt, eq = pl.pallas_call(
        functools.partial(_tie_count_atomic_kernel, block_n=block_n, k=k),
        in_specs=[row, per_row, any_space],
        out_specs=[_per_block_spec(), _per_block_spec()],
        out_shape=[jax.ShapeDtypeStruct((R, width), jnp.int32)] * 2,
        compiler_params=_compiler_params(num_stages=1),
        name="topk_tie_count_atomic",
        **common,
    )(x, row_len, totals)
    return pl.pallas_call(
        functools.partial(_compact_atomic_kernel, block_n=block_n, nb=nb, k=k),
        in_specs=[row, per_row, any_space, any_space, any_space],
        out_specs=any_space,
        out_shape=jax.ShapeDtypeStruct((R, k), jnp.int32),
        compiler_params=_compiler_params(num_stages=1),
        name="topk_compact_atomic",
        **common,
    )(x, row_len, totals, gt, eq)


@functools.partial(jax.jit, static_argnames=("k", "block_n", "interpret"))
def topk_positions_reference(
    scores: jax.Array,
    k: int,
    query_positions: jax.Array | None = None,
    *,
    block_n: int = 1024,
    interpret: bool = False,
) -> jax.Array:
    """Pure-jnp ``topk_positions``: stable ``lax.top_k``, then ascending sort.

    ``lax.top_k`` orders -0.0 below +0.0, so zeros are canonicalised first to keep
    the "equal scores: lower position wins" rule. ``query_positions`` only lets the kernel skip work; the
    selection is the same without it.
    """
    del block_n, interpret, query_positions
    N = scores.shape[-1]
    _check_k(k, N)
    x = scores.astype(jnp.float32)
    x = jnp.where(x == 0.0, 0.0, x)
    _, idx = lax.top_k(x, k)
    return jnp.sort(idx, axis=-1).astype(jnp.int32)
