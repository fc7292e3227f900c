"""Sparse MLA attention of decode rows over their gathered history rows, in one pass (flash-decoding, split over
the rows).

Each query row r (a lane's decode token, or one of an MTP verify step's rows) attends, with all ``h`` heads in
the latent space (absorbed MLA), to the K history rows its DSA selection gathered:

    scores[h, k] = (q_lat[h] . lat[k] + q_rope[h] . rope[k]) * softmax_scale, -inf where not attend[k]
    o_lat[h]     = softmax(scores[h]) @ lat

The model computes this with einsums: two score GEMMs, the mask, the softmax's reductions and the weighted sum,
each a kernel that reads or writes an [h, K] or [K, C] array (in ``profile_decode_8k_8f038d6.json`` the
attention's reduce fusions alone took 184.7 us of a 3.8 ms batch-1 step, ~5.8 us each, for arrays of ~0.5 MB).
Here program (r, s, p) reads its split s of the rows, keeps an online softmax over them (running max and sum per
head) for its part p's heads, and accumulates its part's slice of the output columns in f32 (all 64 heads' whole
[64, 512] accumulator would not fit the registers: a part is a block of heads times a slice of the columns); a
small jnp combine merges the splits.

The heads share every history row (MLA's latent is one "key" for all heads), so a program holds a block of heads'
queries and each row block is one [hb, C] x [C, BK] score dot and one [hb, BK] x [BK, C / parts] output dot.

Numerics: scores and the softmax in f32; probabilities are cast to the rows' dtype for the output dot with f32
accumulation, as the reference does, but unnormalised (each split's running max subtracted, not the row's), and
the division by the sum happens once at the end. So the kernel agrees with ``mla_decode_reference`` to the
rounding of the probabilities, not bit for bit. A row with nothing to attend to gives NaN, as the reference's
softmax of all -inf does.

**Measured slower than XLA's einsums, so the model does not call it.** On the H200
(``experiments/results/bench_mla_decode_c53beac.json``: row blocks, head blocks, column parts and warps swept) its
fastest launch shape took 14.3 us at one query row against the einsums' 13.8, 36.0 against 29.4 at ten rows and
106 against 93 at forty. At batch 1 the einsums cost ~14 us a layer, ~110 us of a 3.5 ms step, so not even a
perfect kernel would gain more than ~3%. Wired into the model it ran batch-1 decode at 282.6 tok/s against 286.4
for the einsums (``generate_8k_mla_kernel_51fc6f7.json``, ``generate_8k_einsum_attention_51fc6f7.json``, one
call). It stays, with its bench, as that measurement and as the starting point of a Mosaic GPU version.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

F32 = jnp.float32


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def supported(heads: int, latent: int, rope: int, rows: int, block_rows: int, head_block: int | None = None,
              column_parts: int = 2) -> bool:
    """Whether the kernel takes these sizes: Triton's dots want power-of-two dims of at least 16."""
    head_block = heads if head_block is None else head_block
    return (all(_pow2(n) and n >= 16 for n in (head_block, latent // max(column_parts, 1), rope, block_rows))
            and heads % head_block == 0 and latent % column_parts == 0 and rows % block_rows == 0)


def default_splits(num_query_rows: int, rows: int, block_rows: int, parts: int = 2, target_programs: int = 256) -> int:
    """Splits of each query row's K history rows: enough programs for the GPU (~2 per SM of an H100 / H200) over
    the ``parts`` (head blocks x column parts) each split runs as, but at least one row block per split. A batch-1
    decode row splits 64 ways at K = 2,048 in 32-row blocks and 2 parts."""
    s = max(1, target_programs // (num_query_rows * parts))
    s = 1 << (s.bit_length() - 1)  # a power of two, so it divides K
    return max(1, min(s, rows // block_rows))


def _kernel(q_lat_ref, q_rope_ref, lat_ref, rope_ref, attend_ref, o_ref, m_ref, l_ref, *, softmax_scale: float,
            block_rows: int, rows_per_split: int, width: int, column_parts: int):
    c = pl.program_id(2) % column_parts
    dot_dtype = lat_ref.dtype
    precision = lax.Precision.HIGHEST if dot_dtype == F32 else lax.Precision.DEFAULT
    q_lat = q_lat_ref[0]  # [hb, C]
    q_rope = q_rope_ref[0]  # [hb, R]
    hb = q_lat.shape[0]
    contract_rows = (((1,), (1,)), ((), ()))  # [hb, C] x [BK, C] -> [hb, BK]

    def block(j, carry):
        m, l, acc = carry
        k0 = j * block_rows
        lat = lat_ref[0, pl.ds(k0, block_rows), :]  # [BK, C]
        rope = rope_ref[0, pl.ds(k0, block_rows), :]  # [BK, R]
        attend = attend_ref[0, pl.ds(k0, block_rows)]  # [BK]
        s = (lax.dot_general(q_lat, lat, contract_rows, precision=precision, preferred_element_type=F32)
             + lax.dot_general(q_rope, rope, contract_rows, precision=precision, preferred_element_type=F32))
        s = jnp.where(attend[None, :], s * softmax_scale, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # no row seen yet: keep exp() away from -inf - -inf
        alpha = jnp.exp(m - m_use)
        p = jnp.exp(s - m_use[:, None])
        l = l * alpha + jnp.sum(p, axis=1)
        if column_parts == 1:
            v = lat
        else:
            v = lat_ref[0, pl.ds(k0, block_rows), pl.ds(c * width, width)]  # [BK, width]: this program's columns
        acc = acc * alpha[:, None] + lax.dot_general(p.astype(dot_dtype), v, (((1,), (0,)), ((), ())),
                                                      precision=precision, preferred_element_type=F32)
        return m_new, l, acc

    init = (jnp.full((hb,), -jnp.inf, F32), jnp.zeros((hb,), F32), jnp.zeros((hb, width), F32))
    m, l, acc = lax.fori_loop(0, rows_per_split // block_rows, block, init)
    o_ref[0, 0] = acc
    m_ref[0, 0, 0] = m
    l_ref[0, 0, 0] = l


@functools.partial(jax.jit, static_argnames=("softmax_scale", "splits", "block_rows", "head_block", "column_parts",
                                             "num_warps", "num_stages", "interpret"))
def mla_decode(q_lat, q_rope, lat, rope, attend, *, softmax_scale: float, splits: int | None = None,
               block_rows: int = 32, head_block: int | None = None, column_parts: int = 2, num_warps: int = 4,
               num_stages: int = 2, interpret: bool = False):
    """``o_lat [Q, h, C]`` in ``lat``'s dtype for query rows ``q_lat [Q, h, C]``, ``q_rope [Q, h, R]`` over their
    gathered rows ``lat [Q, K, C]``, ``rope [Q, K, R]`` where ``attend [Q, K]`` (bool).

    Launch shape: programs ``(query row, split of the K rows, part)``, a part being one block of ``head_block``
    heads (default all) times one of ``column_parts`` slices of the output columns. Each part computes its heads'
    scores over the whole row (so parts re-read a split's rows, mostly from L2) and accumulates ``[head_block,
    C / column_parts]`` f32: fewer heads or columns a program means fewer registers, more parts more re-reads."""
    Q, h, C = q_lat.shape
    R = q_rope.shape[-1]
    K = lat.shape[1]
    hb = h if head_block is None else head_block
    if lat.shape != (Q, K, C) or rope.shape != (Q, K, R) or q_rope.shape != (Q, h, R) or attend.shape != (Q, K):
        raise ValueError(f"mla_decode: q_lat {q_lat.shape}, q_rope {q_rope.shape}, lat {lat.shape}, rope "
                         f"{rope.shape}, attend {attend.shape} do not agree on [Q, h, C] / [Q, K, C] / [Q, K, R]")
    if not supported(h, C, R, K, block_rows, hb, column_parts):
        raise ValueError(f"mla_decode needs power-of-two head_block ({hb}, dividing heads {h}), latent / "
                         f"column_parts ({C} / {column_parts}), rope ({R}) and block_rows ({block_rows}), each >= "
                         f"16, and K ({K}) a multiple of block_rows")
    parts = (h // hb) * column_parts
    S = default_splits(Q, K, block_rows, parts) if splits is None else splits
    if not _pow2(S) or K % (S * block_rows):
        raise ValueError(f"splits ({S}) must be a power of two with K ({K}) a multiple of splits x block_rows")
    Ks, width, cp = K // S, C // column_parts, column_parts
    kwargs = ({} if interpret else
              {"compiler_params": plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)})
    acc, m, l = pl.pallas_call(
        functools.partial(_kernel, softmax_scale=softmax_scale, block_rows=block_rows, rows_per_split=Ks,
                          width=width, column_parts=cp),
        out_shape=[jax.ShapeDtypeStruct((Q, S, h, C), F32), jax.ShapeDtypeStruct((Q, S, cp, h), F32),
                   jax.ShapeDtypeStruct((Q, S, cp, h), F32)],
        grid=(Q, S, parts),
        in_specs=[pl.BlockSpec((1, hb, C), lambda q, s, p: (q, p // cp, 0)),
                  pl.BlockSpec((1, hb, R), lambda q, s, p: (q, p // cp, 0)),
                  pl.BlockSpec((1, Ks, C), lambda q, s, p: (q, s, 0)),
                  pl.BlockSpec((1, Ks, R), lambda q, s, p: (q, s, 0)),
                  pl.BlockSpec((1, Ks), lambda q, s, p: (q, s))],
        out_specs=[pl.BlockSpec((1, 1, hb, width), lambda q, s, p: (q, s, p // cp, p % cp)),
                   pl.BlockSpec((1, 1, 1, hb), lambda q, s, p: (q, s, p % cp, p // cp)),
                   pl.BlockSpec((1, 1, 1, hb), lambda q, s, p: (q, s, p % cp, p // cp))],
        interpret=interpret, name="glm53_mla_decode", **kwargs,
    )(q_lat, q_rope, lat, rope, attend)
    # Every column part of a head block saw the same scores: its running max and sum are the same; take the first's.
    m, l = m[:, :, 0], l[:, :, 0]  # [Q, S, h]
    top = jnp.max(m, axis=1, keepdims=True)
    weight = jnp.exp(m - jnp.where(top == -jnp.inf, 0.0, top))  # [Q, S, h]
    total = jnp.sum(weight * l, axis=1)  # [Q, h]
    out = jnp.sum(weight[..., None] * acc, axis=1) / total[..., None]
    return out.astype(lat.dtype)


@functools.partial(jax.jit, static_argnames=("softmax_scale", "splits", "block_rows", "head_block", "column_parts",
                                             "num_warps", "num_stages", "interpret"))
def mla_decode_reference(q_lat, q_rope, lat, rope, attend, *, softmax_scale: float, splits: int | None = None,
                         block_rows: int = 32, head_block: int | None = None, column_parts: int = 2,
                         num_warps: int = 4, num_stages: int = 2, interpret: bool = False):
    """Pure-jnp ``mla_decode`` (same signature; the launch arguments unused): the model's einsums. Leading dims
    may be any batch shape."""
    del splits, block_rows, head_block, column_parts, num_warps, num_stages, interpret
    scores = (jnp.einsum("...hc,...kc->...hk", q_lat, lat, preferred_element_type=F32)
              + jnp.einsum("...hr,...kr->...hk", q_rope, rope, preferred_element_type=F32))
    scores = jnp.where(attend[..., None, :], scores * softmax_scale, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(lat.dtype)
    return jnp.einsum("...hk,...kc->...hc", probs, lat)
