"""Hot gather: each selected KV row from the recent ring, a hot-cache slot (hit) or host memory (miss).

The article's final design ("let the GPU manage the hot cache directly"): the DSA selection never leaves the
device; one kernel reads every selected row from wherever it is and writes the compact rows attention consumes.
Misses are read straight from the ``pinned_host`` history planes, zero-copy over PCIe (measured to work with
Pallas's Triton lowering and ``memory_space=ANY`` operands: h200-probe.md).

Rows are moved as raw packed planes (no dequantisation here): the compact buffer is also what the fill step copies
into victim slots, and a dequantised row cannot be re-packed to the same bytes. The caller dequantises the compact
rows with ``glm53.kv_formats.unpack`` (a few hundred KiB of elementwise work).

Each entry's source is decided before the kernel (``source``: 0 ring, 1 hot, 2 host) together with its row in that
source's flat ``[rows, W]`` plane. Loads are masked per source, so a hit never touches host memory and a miss never
touches the hot cache.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

RING, HOT, HOST = 0, 1, 2


def _is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def _hot_gather_kernel(source_ref, row_ref, *refs, n_planes: int, block_rows: int):
    """One program gathers ``block_rows`` entries for every plane.

    Refs (ANY = the whole array where it lives; flat planes):
      source_ref: [E] int32, ANY — 0 ring, 1 hot, 2 host
      row_ref:    [E] int32, ANY — row within that source's plane
      then per plane p: ring_ref [R_total, W_p], hot_ref [H_total, W_p], host_ref [N_host, W_p] (ANY)
      then per plane p: out_ref [block_rows, W_p]
    """
    ins, outs = refs[: 3 * n_planes], refs[3 * n_planes:]
    i = pl.program_id(0)
    source = source_ref[pl.ds(i * block_rows, block_rows)]  # [block_rows]
    row = row_ref[pl.ds(i * block_rows, block_rows)]
    masks = [source == s for s in (RING, HOT, HOST)]
    for p in range(n_planes):
        out_ref = outs[p]
        width = out_ref.shape[1]
        cols = jnp.arange(width, dtype=jnp.int32)[None, :]  # [1, W]: all-array indices -> one pointer tile
        value = jnp.zeros(out_ref.shape, out_ref.dtype)
        for src_ref, m in zip(ins[3 * p: 3 * p + 3], masks):
            # Masked-off lanes issue no memory access; their row index is pinned to 0 so addresses stay in range.
            part = plgpu.load(src_ref.at[jnp.where(m, row, 0)[:, None], cols], mask=m[:, None], other=0)
            value = jnp.where(m[:, None], part, value)
        out_ref[...] = value


def _validate(source, row, ring, hot, host, block_rows):
    if not _is_pow2(block_rows):
        raise ValueError(f"block_rows must be a power of two, got {block_rows}")
    if source.shape != row.shape or source.ndim != 1:
        raise ValueError(f"source and row must be matching 1-D arrays, got {source.shape} and {row.shape}")
    if source.shape[0] % block_rows:
        raise ValueError(f"the number of entries {source.shape[0]} must be a multiple of block_rows={block_rows}")
    if not (ring.keys() == hot.keys() == host.keys()):
        raise ValueError(f"ring, hot and host planes differ: {sorted(ring)}, {sorted(hot)}, {sorted(host)}")
    for name in ring:
        widths = {ring[name].shape[1], hot[name].shape[1], host[name].shape[1]}
        dtypes = {ring[name].dtype, hot[name].dtype, host[name].dtype}
        if len(widths) != 1 or len(dtypes) != 1:
            raise ValueError(f"plane {name!r}: ring/hot/host widths {widths} or dtypes {dtypes} differ")
        (w,) = widths
        if not _is_pow2(w):
            raise ValueError(f"plane {name!r}: width {w} must be a power of two (Triton lowering)")


@functools.partial(jax.jit, static_argnames=("block_rows", "num_warps", "interpret"))
def hot_gather(source: jax.Array, row: jax.Array, ring: dict, hot: dict, host: dict, *, block_rows: int = 16,
               num_warps: int = 4, interpret: bool = False) -> dict:
    """Gather entries ``e`` of ``source``/``row`` (``[E]``) from the flat ``[rows, W]`` planes of the ring, the
    hot cache and host memory. Returns ``{plane: [E, W]}`` packed rows (same dtypes as the planes)."""
    _validate(source, row, ring, hot, host, block_rows)
    names = sorted(ring)
    E = source.shape[0]
    operands, in_specs = [source, row], [pl.BlockSpec(memory_space=pl.ANY)] * 2
    for name in names:
        operands += [ring[name], hot[name], host[name]]
        in_specs += [pl.BlockSpec(memory_space=pl.ANY)] * 3
    out_shape = [jax.ShapeDtypeStruct((E, ring[n].shape[1]), ring[n].dtype) for n in names]
    out_specs = [pl.BlockSpec((block_rows, ring[n].shape[1]), lambda i: (i, 0)) for n in names]
    kwargs = {} if interpret else {"compiler_params": plgpu.CompilerParams(num_warps=num_warps, num_stages=1)}
    outs = pl.pallas_call(
        functools.partial(_hot_gather_kernel, n_planes=len(names), block_rows=block_rows),
        out_shape=out_shape, grid=(E // block_rows,), in_specs=in_specs, out_specs=out_specs,
        interpret=interpret, name="glm53_hot_gather", **kwargs,
    )(*operands)
    return dict(zip(names, outs))


def hot_gather_reference(source: jax.Array, row: jax.Array, ring: dict, hot: dict, host: dict, *,
                         block_rows: int = 16, num_warps: int = 4, interpret: bool = False) -> dict:
    """Pure-jnp reference with the same signature. ``host`` planes must be readable by XLA's gather here (device
    arrays; a caller holding ``pinned_host`` planes moves them first — the CPU fallback does)."""
    del num_warps, interpret
    _validate(source, row, ring, hot, host, block_rows)
    out = {}
    for name in ring:
        vals = [jnp.take(src[name], jnp.where(source == s, row, 0), axis=0)
                for s, src in ((RING, ring), (HOT, hot), (HOST, host))]
        sel = source[:, None]
        out[name] = jnp.where(sel == RING, vals[0], jnp.where(sel == HOT, vals[1], vals[2]))
    return out
