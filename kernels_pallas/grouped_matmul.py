"""Grouped matmul for MoE experts: rows sorted by group, each group multiplied by its own weight matrix.

``out[r] = x[r] @ w[g(r)]`` where rows ``[start_g, start_g + sizes[g])`` belong to group g (``jax.lax.ragged_dot``'s
semantics). Why a kernel: XLA's GPU backend rewrites ``ragged_dot`` into a dense dot of every row with every
group's matrix (zero-padded; openxla/xla#40189 and #45996 describe the rewrite and the faster backends that are
not the default on CUDA), so a prefill chunk of a 16-expert MoE did 16x the FLOPs it needs, and a decode step read
every expert's weights where its tokens route to a few. Here each program works on one (row tile, group) *visit*: only groups that have rows are
visited, so the bytes read are the routed experts' and the FLOPs are the rows' own (plus the tile's padding).

Schedule (like megablox's ``make_group_metadata``): a group of rows ``[start, end)`` spans the row tiles
``start // BM .. (end - 1) // BM``; visits are listed group by group, so there are at most ``tiles + G - 1`` of them
(each group boundary inside a tile adds one). A visit loads its whole tile of ``x`` and the group's weight blocks
and stores only the rows of its group (masked store into the output, so two visits of one tile never overwrite
each other's rows). Each program works its own visit out from the group sizes (two prefix sums over G, a few
hundred instructions). That schedule was jnp glue before the kernel, and XLA fused its prefix sums and search into
one loop fusion that recomputed the inner prefix sums for every element of the outer ones and of the search
(O(G^3) work per visit): 21 us a layer on the H200 at G = 16, 3.9% of a batch-1 decode step
(``experiments/results/profile_decode_8k_8f038d6.json``), and it would have grown with GLM-5's 256 experts as
4,096x that.

FP8 weights (``w_scale``): ``w`` in float8_e4m3fn with one f32 scale per 128 x 128 block of each group's ``[K, N]``
matrix (the layout of published GLM-5-FP8 / DeepSeek-V3 checkpoints, transposed), dequantised inside the kernel
block by block as ``(w * scale).astype(x.dtype)``: the same arithmetic as dequantising on load
(``dequantize_blocks``), so the dot multiplies the same bf16 operands while HBM reads half the bytes of bf16. The
output is bit-identical to the dequantised weights' in the interpreter; compiled for the H200 the converted operand
takes another MMA path, whose f32 summation order differs (outputs equal to bf16 rounding; measured).
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


SCALE_BLOCK = 128  # FP8 weights: one scale per 128 x 128 block


def quantize_blocks(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``w [..., K, N]`` -> (float8_e4m3fn ``[..., K, N]``, f32 scales ``[..., ceil(K/128), ceil(N/128)]``), one
    scale (amax / 448) per 128 x 128 block, as FP8 checkpoints store them."""
    *lead, K, N = w.shape
    kb, nb = -(-K // SCALE_BLOCK), -(-N // SCALE_BLOCK)
    wf = jnp.pad(w.astype(jnp.float32), [(0, 0)] * len(lead) + [(0, kb * SCALE_BLOCK - K), (0, nb * SCALE_BLOCK - N)])
    blocks = wf.reshape(*lead, kb, SCALE_BLOCK, nb, SCALE_BLOCK)
    amax = jnp.max(jnp.abs(blocks), axis=(-3, -1))
    scale = jnp.where(amax > 0, amax / 448.0, 1.0).astype(jnp.float32)
    q = jnp.clip(blocks / scale[..., :, None, :, None], -448.0, 448.0).astype(jnp.float8_e4m3fn)
    return q.reshape(*lead, kb * SCALE_BLOCK, nb * SCALE_BLOCK)[..., :K, :N], scale


def dequantize_blocks(w: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """``(w * scale)`` per 128 x 128 block, in f32, rounded to ``dtype``: what the kernel computes per block, and
    how ``glm53.checkpoint`` dequantises FP8 checkpoints on load."""
    K, N = w.shape[-2:]
    s = jnp.repeat(jnp.repeat(scale.astype(jnp.float32), SCALE_BLOCK, axis=-2)[..., :K, :], SCALE_BLOCK,
                   axis=-1)[..., :N]
    return (w.astype(jnp.float32) * s).astype(dtype)


def _visit(sizes_ref, v, *, block_m: int):
    """Visit ``v``'s group (``G`` or more: no visit), its row tile, and the group's row range ``[start, end)``,
    from the group sizes (``[G]``, G a power of two: the wrapper pads with empty groups)."""
    sizes = sizes_ref[...]
    G = sizes.shape[0]
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    # Row counts are never negative, so truncating division is floor division (and needs no sign fix-ups).
    first = lax.div(starts, jnp.int32(block_m))
    last = lax.div(jnp.maximum(ends - 1, 0), jnp.int32(block_m))
    visits = jnp.where(sizes > 0, last - first + 1, 0)
    visit_end = jnp.cumsum(visits)
    g = jnp.sum((visit_end <= v).astype(jnp.int32))  # groups whose visits all come before v
    at_g = jnp.arange(G, dtype=jnp.int32) == g

    def pick(a):
        return jnp.sum(jnp.where(at_g, a, 0))

    tile = pick(first) + v - (pick(visit_end) - pick(visits))
    return g, tile, pick(starts), pick(ends)


def _kernel(
    sizes_ref,  # [Gp] int32 rows of each group (Gp a power of two, empty groups past G), ANY
    x_ref,  # [Mp, K], ANY
    *refs,  # w_ref [G, K, N] x num_weights, (s_ref [G, K/128, N/128] f32: FP8 block scales) x num_weights if fp8,
    #         o_ref [Mp, N]; all ANY (the output by masked stores)
    num_weights: int,
    fp8: bool,
    num_groups: int,
    block_m: int,
    block_n: int,
    block_k: int,
    dot_dtype,
):
    """One visit's ``[block_m, block_n]`` tile of ``x @ w`` (one weight), or of ``silu(x @ w_gate) * (x @ w_up)``
    (two: the experts' SwiGLU, both products from one pass over ``x``'s tile)."""
    w_refs = refs[:num_weights]
    s_refs = refs[num_weights:2 * num_weights] if fp8 else (None,) * num_weights
    o_ref = refs[-1]
    v, j = pl.program_id(0), pl.program_id(1)
    g, tile, start, end = _visit(sizes_ref, v, block_m=block_m)

    @pl.when(g < num_groups)
    def _():
        row0 = tile * block_m
        col0 = j * block_n
        K = x_ref.shape[1]
        precision = lax.Precision.HIGHEST if dot_dtype == jnp.float32 else lax.Precision.DEFAULT

        def step(k, accs):
            xs = x_ref[pl.ds(row0, block_m), pl.ds(k * block_k, block_k)].astype(dot_dtype)
            out = []
            for acc, w_ref, s_ref in zip(accs, w_refs, s_refs):
                ws = w_ref[g, pl.ds(k * block_k, block_k), pl.ds(col0, block_n)]
                if s_ref is not None:  # the tile lies inside one 128 x 128 scale block (block_k, block_n divide 128)
                    scale = s_ref[g, (k * block_k) // SCALE_BLOCK, col0 // SCALE_BLOCK]
                    ws = (ws.astype(jnp.float32) * scale).astype(x_ref.dtype)
                ws = ws.astype(dot_dtype)
                out.append(acc + lax.dot_general(xs, ws, (((1,), (0,)), ((), ())), precision=precision,
                                                 preferred_element_type=jnp.float32))
            return tuple(out)

        zeros = tuple(jnp.zeros((block_m, block_n), jnp.float32) for _ in w_refs)
        accs = lax.fori_loop(0, K // block_k, step, zeros)
        if num_weights == 1:
            y = accs[0].astype(o_ref.dtype)
        else:
            # jax.nn.silu(gate) * up in the output dtype, op by op as JAX lowers it (silu = x * sigmoid(x), sigmoid
            # = 1 / (1 + exp(-x))): each product and each elementwise result rounded to that dtype, as the two
            # separate matmuls and the elementwise ops after them round. Computed in f32 because Triton's lowering
            # has no bf16 arithmetic.
            def rounded(a):
                return a.astype(o_ref.dtype).astype(jnp.float32)

            gate, up = (rounded(a) for a in accs)
            sigmoid = rounded(1.0 / rounded(1.0 + rounded(jnp.exp(-gate))))
            y = (rounded(gate * sigmoid) * up).astype(o_ref.dtype)
        rows = row0 + lax.broadcasted_iota(jnp.int32, (block_m, block_n), 0)
        mine = (rows >= start) & (rows < end)
        plgpu.store(o_ref.at[pl.ds(row0, block_m), pl.ds(col0, block_n)], y, mask=mine)


def _padded_sizes(group_sizes: jax.Array) -> jax.Array:
    """The group sizes as the programs read them: whole, at a power-of-two length (Triton), empty groups after."""
    G = group_sizes.shape[0]
    return jnp.pad(group_sizes.astype(jnp.int32), (0, _next_pow2(G) - G))


def _schedule(group_sizes: jax.Array, num_tiles: int, block_m: int):
    """Every visit's row tile, group (``G``: no visit) and group row range ``[start, end)``, as the kernel's programs
    work them out (``_visit``, here on the array itself instead of a ref): for tests."""
    G = group_sizes.shape[0]
    sizes = _padded_sizes(group_sizes)
    g, tile, start, end = (jnp.stack(parts) for parts in zip(
        *(_visit(sizes, jnp.int32(v), block_m=block_m) for v in range(num_tiles + G - 1))))
    return tile, jnp.minimum(g, G), start, end


def _validate(x, w, group_sizes, w_scale):
    if x.ndim != 2 or w.ndim != 3 or group_sizes.ndim != 1:
        raise ValueError(f"expected x[M, K], w[G, K, N], group_sizes[G]; got {x.shape}, {w.shape}, "
                         f"{group_sizes.shape}")
    if w.shape[1] != x.shape[1] or w.shape[0] != group_sizes.shape[0]:
        raise ValueError(f"x[M, K] = {x.shape}, w[G, K, N] = {w.shape} and group_sizes[G] = {group_sizes.shape} "
                         "disagree")
    fp8 = w.dtype == jnp.float8_e4m3fn
    if fp8 != (w_scale is not None):
        raise ValueError(f"float8_e4m3fn weights need their w_scale (and only they have one); got {w.dtype} weights "
                         f"and w_scale {None if w_scale is None else w_scale.shape}")
    if fp8:
        G, K, N = w.shape
        want = (G, -(-K // SCALE_BLOCK), -(-N // SCALE_BLOCK))
        if w_scale.shape != want:
            raise ValueError(f"w_scale must be [G, ceil(K/128), ceil(N/128)] = {want}, got {w_scale.shape}")


def _validate_pair(w_gate, w_up):
    if w_gate.shape != w_up.shape or w_gate.dtype != w_up.dtype:
        raise ValueError(f"w_gate {w_gate.shape} {w_gate.dtype} and w_up {w_up.shape} {w_up.dtype} must agree")


def block_rows_for(M: int) -> int:
    """Row tile: small for decode (a few routed rows: padding would cost FLOPs, not bytes), 64 for prefill."""
    return 16 if M <= 128 else 64


def _grouped(x, ws: tuple, group_sizes, scales: tuple, *, block_m, block_n, block_k, interpret, name: str):
    """The kernel over ``ws`` (one weight: its product; two: the SwiGLU of theirs) with the shared checks."""
    for w, w_scale in zip(ws, scales):
        _validate(x, w, group_sizes, w_scale)
    if len(ws) == 2:
        _validate_pair(*ws)
    M, K = x.shape
    G, _, N = ws[0].shape
    bm = block_m or block_rows_for(M)
    bn, bk = min(block_n, N), min(block_k, K)
    if K % bk or N % bn:
        raise ValueError(f"K={K} must be a multiple of block_k={bk} and N={N} of block_n={bn}")
    num_tiles = -(-M // bm)
    Mp = num_tiles * bm
    xp = jnp.pad(x, ((0, Mp - M), (0, 0))) if Mp != M else x
    sizes = _padded_sizes(group_sizes)
    fp8 = scales[0] is not None
    if fp8 and (SCALE_BLOCK % bk or SCALE_BLOCK % bn):
        raise ValueError(f"FP8 weights: block_k={bk} and block_n={bn} must divide the {SCALE_BLOCK}-wide scale blocks")
    dot_dtype = jnp.float32 if jnp.float32 in (x.dtype, ws[0].dtype) else jnp.bfloat16
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    scale_args = [s.astype(jnp.float32) for s in scales] if fp8 else []
    out = pl.pallas_call(
        functools.partial(_kernel, num_weights=len(ws), fp8=fp8, num_groups=G, block_m=bm, block_n=bn, block_k=bk,
                          dot_dtype=dot_dtype),
        grid=(num_tiles + G - 1, N // bn),
        in_specs=[any_spec] * (2 + len(ws) + len(scale_args)),
        out_specs=any_spec,
        out_shape=jax.ShapeDtypeStruct((Mp, N), x.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=3),
        interpret=interpret,
        name=name,
    )(sizes, xp, *ws, *scale_args)
    return out[:M]


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "block_k", "interpret"))
def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, w_scale: jax.Array | None = None, *,
                   block_m: int | None = None, block_n: int = 128, block_k: int = 64,
                   interpret: bool = False) -> jax.Array:
    """``jax.lax.ragged_dot(x, w, group_sizes)`` for rows sorted by group: ``[M, N]`` in ``x``'s dtype, f32
    accumulation (bf16 inputs: tensor-core dots; f32 inputs: HIGHEST precision). ``sum(group_sizes)`` must be M
    (every row belongs to a group). K a multiple of ``block_k``, N of ``block_n``. FP8 weights come with
    ``w_scale`` (see the module doc)."""
    return _grouped(x, (w,), group_sizes, (w_scale,), block_m=block_m, block_n=block_n, block_k=block_k,
                    interpret=interpret, name="grouped_matmul")


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "block_k", "interpret"))
def grouped_swiglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, group_sizes: jax.Array,
                   gate_scale: jax.Array | None = None, up_scale: jax.Array | None = None, *,
                   block_m: int | None = None, block_n: int = 128, block_k: int = 64,
                   interpret: bool = False) -> jax.Array:
    """The experts' SwiGLU ``silu(x @ w_gate[g]) * (x @ w_up[g])`` per group in one launch (each tile of ``x`` read
    once for both products, no XLA fusion after): what two ``grouped_matmul`` calls and an elementwise fusion
    compute, each product rounded to ``x``'s dtype before the SwiGLU as there. Same arguments as ``grouped_matmul``,
    for two weights of one shape (FP8 ones with their scales)."""
    return _grouped(x, (w_gate, w_up), group_sizes, (gate_scale, up_scale), block_m=block_m, block_n=block_n,
                    block_k=block_k, interpret=interpret, name="grouped_swiglu")


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "block_k", "interpret"))
def grouped_matmul_reference(x: jax.Array, w: jax.Array, group_sizes: jax.Array, w_scale: jax.Array | None = None,
                             *, block_m: int | None = None, block_n: int = 128, block_k: int = 64,
                             interpret: bool = False) -> jax.Array:
    """Pure-jnp ``grouped_matmul`` (same signature; blocks and interpret unused): ``jax.lax.ragged_dot`` with f32
    accumulation, FP8 weights dequantised first."""
    del block_m, block_n, block_k, interpret
    _validate(x, w, group_sizes, w_scale)
    if w_scale is not None:
        w = dequantize_blocks(w, w_scale, x.dtype)
    precision = lax.Precision.HIGHEST if jnp.float32 in (x.dtype, w.dtype) else None
    out = lax.ragged_dot(x, w, group_sizes.astype(jnp.int32), precision=precision,
                         preferred_element_type=jnp.float32)
    return out.astype(x.dtype)


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "block_k", "interpret"))
def grouped_swiglu_reference(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, group_sizes: jax.Array,
                             gate_scale: jax.Array | None = None, up_scale: jax.Array | None = None, *,
                             block_m: int | None = None, block_n: int = 128, block_k: int = 64,
                             interpret: bool = False) -> jax.Array:
    """Pure-jnp ``grouped_swiglu`` (same signature): the two reference products and the SwiGLU, in ``x``'s dtype."""
    del block_m, block_n, block_k, interpret
    _validate_pair(w_gate, w_up)
    gate = grouped_matmul_reference(x, w_gate, group_sizes, gate_scale)
    up = grouped_matmul_reference(x, w_up, group_sizes, up_scale)
    return (jax.nn.silu(gate) * up).astype(x.dtype)
