"""Copy blocks of rows between two sets of flat planes, in place, wherever either set lives.

The offload cache moves rows in blocks of up to ``block_size`` contiguous rows: ring rows to their host page
(copyback, flush), host pages to device buffers (bulk reads, rollback, save) and restored rows to both. Each block
i copies ``count[i]`` rows (at most ``block_size``; none when <= 0) from ``src`` rows ``src_start[i] + r`` to
``dst`` rows ``dst_start[i] + r``. Rows of a block past its count are not written at all, not even with their old
values, and blocks target disjoint destination rows, so programs never race.

Every operand is ``memory_space=pl.ANY``: the kernel gets raw pointers, so either side may be a ``pinned_host``
array that a GPU reads or writes zero-copy over PCIe (h200-probe.md: Pallas reads and writes host memory in place;
XLA's own scatters into ``pinned_host`` are known to crash on GPU, openxla/xla #34565). ``dst`` is aliased input ->
output and donated, so only the copied rows move. A program whose rows all lie past its block's count returns at
once: the work follows the rows copied, not the static ``NB x block_size``.

Layout follows jax/experimental/pallas/ops/gpu: kernel body, wrapper, public op, pure-jnp reference with the same
signature.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas.hot_gather import check_addressable
from kernels_pallas.index_math import take_rows


def _is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def _copy_kernel(src_start_ref, dst_start_ref, count_ref, *refs, n_planes: int, block_size: int, block_rows: int):
    """Program (i, j) copies rows [j * block_rows, (j + 1) * block_rows) of block i.

    Refs (all ANY; planes sorted by name):
      src_start_ref, dst_start_ref, count_ref: [NB] int32
      src planes: per plane [R_src, W_p]
      dst planes (aliased inputs, unused: the outputs are the same buffers), then dst outputs: per plane [R_dst, W_p]
    """
    src_refs = refs[:n_planes]
    dst_refs = refs[2 * n_planes:]
    i, j = pl.program_id(0), pl.program_id(1)
    n = jnp.minimum(count_ref[i], block_size)

    @pl.when(j * block_rows < n)
    def _copy():
        r = j * block_rows + jnp.arange(block_rows, dtype=jnp.int32)
        mask = r < n
        src = src_start_ref[i] + jnp.where(mask, r, 0)
        for src_ref, dst_ref in zip(src_refs, dst_refs):
            # Masked-off rows point past the end of this plane (planes may differ in padding rows): GPUs skip them
            # anyway, but the Pallas interpreter writes every row (the old value where masked), which at an
            # in-range dummy row could undo another block's copy.
            dst = jnp.where(mask, dst_start_ref[i] + r, dst_ref.shape[0])
            cols = jnp.arange(dst_ref.shape[1], dtype=jnp.int32)[None, :]
            # No fill value: masked-off rows are never stored, and the Triton lowering has no fp8 constant for one.
            val = plgpu.load(src_ref.at[src[:, None], cols], mask=mask[:, None])  # [block_rows, W_p]
            plgpu.store(dst_ref.at[dst[:, None], cols], val, mask=mask[:, None])


def _validate(dst, src, src_start, dst_start, count, block_size: int, block_rows: int, *, compiled: bool):
    if not _is_pow2(block_size) or not _is_pow2(block_rows) or block_rows > block_size:
        raise ValueError(f"block_size={block_size} and block_rows={block_rows} must be powers of two with "
                         "block_rows <= block_size")
    if not dst or dst.keys() != src.keys():
        raise ValueError(f"dst and src must hold the same planes, got {sorted(dst)} and {sorted(src)}")
    # The planes of one side may differ in rows: a plane can carry padding rows past the ones addressed, so the
    # Triton lowering addresses it right (glm53.cache.addressable_planes). Copied rows must lie inside every plane.
    for side, planes in (("dst", dst), ("src", src)):
        if any(v.ndim != 2 for v in planes.values()):
            raise ValueError(f"{side} planes must be [R, W], got { {n: v.shape for n, v in planes.items()} }")
    for name in dst:
        d, s = dst[name], src[name]
        if d.shape[1] != s.shape[1] or d.dtype != s.dtype:
            raise ValueError(f"plane {name!r}: dst {d.dtype}{list(d.shape)} and src {s.dtype}{list(s.shape)} "
                             "differ in width or dtype")
        if not _is_pow2(d.shape[1]):
            raise ValueError(f"plane {name!r}: width {d.shape[1]} must be a power of two (Triton lowering)")
    for a, what in ((src_start, "src_start"), (dst_start, "dst_start"), (count, "count")):
        if a.ndim != 1 or a.shape != src_start.shape or not jnp.issubdtype(a.dtype, jnp.integer):
            raise ValueError(f"src_start, dst_start and count must be int[NB] of one shape; {what} is "
                             f"{a.dtype}{list(a.shape)}, src_start {list(src_start.shape)}")
    # Row starts are int32 and the kernel points masked-off rows one past dst's end (kernels_pallas.hot_gather:
    # addressing): both sides hold fewer than 2**31 rows; byte offsets past 2**31 are the lowering's (64-bit).
    check_addressable(dst, "dst", compiled=compiled)
    check_addressable(src, "src", compiled=compiled)


@functools.partial(jax.jit, static_argnames=("block_size", "block_rows", "num_warps", "interpret"),
                   donate_argnames=("dst",))
def copy_blocks(dst: dict, src: dict, src_start: jax.Array, dst_start: jax.Array, count: jax.Array, *,
                block_size: int, block_rows: int = 16, num_warps: int = 4, interpret: bool = False) -> dict:
    """``dst[p][dst_start[i] + r] = src[p][src_start[i] + r]`` for every plane p, block i and ``r < min(count[i],
    block_size)``; other rows of ``dst`` keep their values.

    Args:
      dst: ``{plane: [R_dst, W]}``, updated in place (aliased and donated); device or ``pinned_host``. Planes
        may differ in rows (padding rows that keep a plane addressable: glm53.cache.addressable_planes).
      src: ``{plane: [R_src, W]}`` with the same planes, widths and dtypes; device or ``pinned_host``.
      src_start, dst_start, count: int32[NB]. Copied rows must lie inside both (the caller's bug otherwise: the
        kernel would touch memory outside the planes, while the reference drops or clamps).
      block_size: the most rows of one block (power of two).
      block_rows: rows per program (power of two, <= block_size).
      num_warps: Triton warps per program.
      interpret: run the Pallas interpreter (CPU tests).

    Returns:
      The new ``dst`` planes.
    """
    _validate(dst, src, src_start, dst_start, count, block_size, block_rows, compiled=not interpret)
    names = tuple(sorted(dst))
    if src_start.shape[0] == 0:
        return dict(dst)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    operands = [src_start.astype(jnp.int32), dst_start.astype(jnp.int32), count.astype(jnp.int32)]
    operands += [src[n] for n in names]
    first_dst = len(operands)
    operands += [dst[n] for n in names]
    kwargs = {} if interpret else {"compiler_params": plgpu.CompilerParams(num_warps=num_warps, num_stages=1)}
    out = pl.pallas_call(
        functools.partial(_copy_kernel, n_planes=len(names), block_size=block_size, block_rows=block_rows),
        out_shape=[jax.ShapeDtypeStruct(dst[n].shape, dst[n].dtype) for n in names],
        grid=(src_start.shape[0], block_size // block_rows),
        in_specs=[any_spec] * len(operands), out_specs=[any_spec] * len(names),
        input_output_aliases={first_dst + p: p for p in range(len(names))},
        interpret=interpret, name="glm53_copy_blocks", **kwargs,
    )(*operands)
    return dict(zip(names, out))


@functools.partial(jax.jit, static_argnames=("block_size", "block_rows", "num_warps", "interpret"),
                   donate_argnames=("dst",))
def copy_blocks_reference(dst: dict, src: dict, src_start: jax.Array, dst_start: jax.Array, count: jax.Array, *,
                          block_size: int, block_rows: int = 16, num_warps: int = 4,
                          interpret: bool = False) -> dict:
    """Pure-jnp ``copy_blocks``: one gather of every block's ``block_size`` rows and one scatter per plane, the rows
    past a block's count sent out of range and dropped. ``dst`` and ``src`` must be readable by XLA's gather and
    scatter here (device arrays; ``kernels_pallas.ops`` moves ``pinned_host`` ones)."""
    del num_warps, interpret
    _validate(dst, src, src_start, dst_start, count, block_size, block_rows, compiled=False)
    r = jnp.arange(block_size, dtype=jnp.int32)[None, :]
    do = r < jnp.clip(count.astype(jnp.int32), 0, block_size)[:, None]  # [NB, block_size]
    src_row = jnp.where(do, src_start.astype(jnp.int32)[:, None] + r, 0).reshape(-1)
    dst_row = dst_start.astype(jnp.int32)[:, None] + r
    return {n: v.at[jnp.where(do, dst_row, v.shape[0]).reshape(-1)].set(
                take_rows(src[n], src_row, axis=0), mode="drop")
            for n, v in dst.items()}
