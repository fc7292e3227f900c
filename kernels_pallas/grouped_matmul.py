"""Grouped matmul for MoE experts: rows sorted by group, each group multiplied by its own weight matrix.

``out[r] = x[r] @ w[g(r)]`` where rows ``[start_g, start_g + sizes[g])`` belong to group g (``jax.lax.ragged_dot``'s
semantics). Why a kernel: XLA's GPU backend rewrites ``ragged_dot`` into a dense dot of every row with every
group's matrix (zero-padded; openxla/xla#40189 and #45996 describe the rewrite and the faster backends that are
not the default on CUDA), so a prefill chunk of a 16-expert MoE did 16x the FLOPs it needs, and a decode step read
every expert's weights where its tokens route to a few. Here each program works on one (row tile, group) *visit*: only groups that have rows are
visited, so the bytes read are the routed experts' and the FLOPs are the rows' own (plus the tile's padding).

Schedule (jnp glue, like megablox's ``make_group_metadata``): a group of rows ``[start, end)`` spans the row tiles
``start // BM .. (end - 1) // BM``; visits are listed group by group, so there are at most ``tiles + G - 1`` of them
(each group boundary inside a tile adds one). A visit loads its whole tile of ``x`` and the group's weight blocks
and stores only the rows of its group (masked store into the output, so two visits of one tile never overwrite
each other's rows).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _kernel(
    tile_ref,  # [V] int32 row tile of each visit, ANY
    group_ref,  # [V] int32 group of each visit (G: no visit), ANY
    start_ref,  # [G + 1] int32 first row of each group, ANY
    end_ref,  # [G + 1] int32 end row of each group, ANY
    x_ref,  # [Mp, K], ANY
    w_ref,  # [G, K, N], ANY
    o_ref,  # [Mp, N], ANY (masked stores)
    *,
    num_groups: int,
    block_m: int,
    block_n: int,
    block_k: int,
    dot_dtype,
):
    v, j = pl.program_id(0), pl.program_id(1)
    g = group_ref[v]

    @pl.when(g < num_groups)
    def _():
        row0 = tile_ref[v] * block_m
        col0 = j * block_n
        K = x_ref.shape[1]
        precision = lax.Precision.HIGHEST if dot_dtype == jnp.float32 else lax.Precision.DEFAULT

        def step(k, acc):
            xs = x_ref[pl.ds(row0, block_m), pl.ds(k * block_k, block_k)].astype(dot_dtype)
            ws = w_ref[g, pl.ds(k * block_k, block_k), pl.ds(col0, block_n)].astype(dot_dtype)
            return acc + lax.dot_general(xs, ws, (((1,), (0,)), ((), ())), precision=precision,
                                         preferred_element_type=jnp.float32)

        acc = lax.fori_loop(0, K // block_k, step, jnp.zeros((block_m, block_n), jnp.float32))
        rows = row0 + lax.broadcasted_iota(jnp.int32, (block_m, block_n), 0)
        mine = (rows >= start_ref[g]) & (rows < end_ref[g])
        plgpu.store(o_ref.at[pl.ds(row0, block_m), pl.ds(col0, block_n)], acc.astype(o_ref.dtype), mask=mine)


def _schedule(group_sizes: jax.Array, num_tiles: int, block_m: int):
    """Per visit: its row tile and group (``G`` past the last real visit), and each group's row range."""
    G = group_sizes.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    first = starts // block_m
    last = jnp.maximum(ends - 1, 0) // block_m
    visits = jnp.where(sizes > 0, last - first + 1, 0)
    visit_end = jnp.cumsum(visits)
    V = num_tiles + G - 1
    v = jnp.arange(V, dtype=jnp.int32)
    group = jnp.searchsorted(visit_end, v, side="right").astype(jnp.int32)  # groups whose visits end <= v
    gc = jnp.minimum(group, G - 1)
    tile = first[gc] + v - (visit_end[gc] - visits[gc])
    tile = jnp.where(group < G, tile, 0)
    pad = jnp.zeros((1,), jnp.int32)
    return tile.astype(jnp.int32), group, jnp.concatenate([starts, pad]), jnp.concatenate([ends, pad])


def _validate(x, w, group_sizes):
    if x.ndim != 2 or w.ndim != 3 or group_sizes.ndim != 1:
        raise ValueError(f"expected x[M, K], w[G, K, N], group_sizes[G]; got {x.shape}, {w.shape}, "
                         f"{group_sizes.shape}")
    if w.shape[1] != x.shape[1] or w.shape[0] != group_sizes.shape[0]:
        raise ValueError(f"x[M, K] = {x.shape}, w[G, K, N] = {w.shape} and group_sizes[G] = {group_sizes.shape} "
                         "disagree")


def block_rows_for(M: int) -> int:
    """Row tile: small for decode (a few routed rows: padding would cost FLOPs, not bytes), 64 for prefill."""
    return 16 if M <= 128 else 64


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "block_k", "interpret"))
def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, block_m: int | None = None,
                   block_n: int = 128, block_k: int = 64, interpret: bool = False) -> jax.Array:
    """``jax.lax.ragged_dot(x, w, group_sizes)`` for rows sorted by group: ``[M, N]`` in ``x``'s dtype, f32
    accumulation (bf16 inputs: tensor-core dots; f32 inputs: HIGHEST precision). ``sum(group_sizes)`` must be M
    (every row belongs to a group). K a multiple of ``block_k``, N of ``block_n``."""
    _validate(x, w, group_sizes)
    M, K = x.shape
    G, _, N = w.shape
    bm = block_m or block_rows_for(M)
    bn, bk = min(block_n, N), min(block_k, K)
    if K % bk or N % bn:
        raise ValueError(f"K={K} must be a multiple of block_k={bk} and N={N} of block_n={bn}")
    num_tiles = -(-M // bm)
    Mp = num_tiles * bm
    xp = jnp.pad(x, ((0, Mp - M), (0, 0))) if Mp != M else x
    tile, group, starts, ends = _schedule(group_sizes, num_tiles, bm)
    dot_dtype = jnp.float32 if jnp.float32 in (x.dtype, w.dtype) else jnp.bfloat16
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    out = pl.pallas_call(
        functools.partial(_kernel, num_groups=G, block_m=bm, block_n=bn, block_k=bk, dot_dtype=dot_dtype),
        grid=(num_tiles + G - 1, N // bn),
        in_specs=[any_spec] * 6,
        out_specs=any_spec,
        out_shape=jax.ShapeDtypeStruct((Mp, N), x.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=3),
        interpret=interpret,
        name="grouped_matmul",
    )(tile, group, starts, ends, xp, w)
    return out[:M]


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "block_k", "interpret"))
def grouped_matmul_reference(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, block_m: int | None = None,
                             block_n: int = 128, block_k: int = 64, interpret: bool = False) -> jax.Array:
    """Pure-jnp ``grouped_matmul`` (same signature; blocks and interpret unused): ``jax.lax.ragged_dot`` with f32
    accumulation."""
    del block_m, block_n, block_k, interpret
    _validate(x, w, group_sizes)
    precision = lax.Precision.HIGHEST if jnp.float32 in (x.dtype, w.dtype) else None
    out = lax.ragged_dot(x, w, group_sizes.astype(jnp.int32), precision=precision,
                         preferred_element_type=jnp.float32)
    return out.astype(x.dtype)
