"""Pallas gather of selected KV-cache rows with in-kernel dequantisation.

Layout follows jax/experimental/pallas/ops/gpu: kernel body, wrapper, public op,
pure-jnp reference with the same signature.

The cache planes (see ``kernels_pallas.kv_formats``), the lanes' plane indices and
the positions are passed with ``memory_space=pl.ANY``: the kernel gets raw pointers
and reads only the selected rows straight from wherever the arrays live. That is what lets the same kernel
read ``pinned_host`` planes zero-copy over PCIe on the GPU (h200-probe.md); a
blocked spec would make Pallas/XLA stage whole blocks instead. Outputs are
ordinary blocked specs, one ``[block_rows, W]`` tile per program.

Lane s of a step reads plane ``plane_of_lane[s]`` (a layer and session slot of the
stacked planes), chosen at run time: the same compiled step serves any lane -> slot
map. Positions must lie in [0, N) and planes in [0, P). Callers clamp; an
out-of-range index is the caller's bug: the kernel would read outside the planes
(undefined), while the reference clamps.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas import kv_formats
from kernels_pallas.hot_gather import check_addressable
from kernels_pallas.index_math import take_rows
from kernels_pallas.kv_formats import KVFormat, from_stored


def _is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def _gather_rows_kernel(plane_ref, pos_ref, latent_ref, *refs, fmt: KVFormat, block_rows: int):
    """One program gathers ``block_rows`` rows of one lane.

    Refs (ANY = whole array in place; outputs have the lane dim squeezed):
      plane_ref:      [S] int32, ANY (lane s reads plane plane_ref[s])
      pos_ref:        [S, M] int32, ANY
      latent_ref:     [P, N, 512] latent dtype as stored (kv_formats.stored_dtype), ANY
      scale_ref:      [P, N, G] scale dtype as stored, ANY (quantised formats only)
      rope_ref:       [P, N, 64] rope dtype as stored, ANY
      latent_out_ref: [block_rows, 512] out dtype
      rope_out_ref:   [block_rows, 64] out dtype
    """
    if fmt.quantised:
        scale_ref, rope_ref, latent_out_ref, rope_out_ref = refs
    else:
        scale_ref = None
        rope_ref, latent_out_ref, rope_out_ref = refs
    lane, j = pl.program_id(0), pl.program_id(1)
    rows = pos_ref[lane, pl.ds(j * block_rows, block_rows)]  # [block_rows]
    # Read from a ref, not scalar-prefetched: Pallas' Triton lowering has no scalar prefetch.
    s = plane_ref[lane]
    # A 3-D ref indexed by (scalar plane, row vector, slice) lowers on Triton to
    # one pointer tensor [block_rows, width] (64-bit offsets once the plane exceeds
    # 4 GiB), and to a gather in interpret mode; no flattening to [P*N, W] needed.
    if fmt.quantised:
        # One group at a time, so the scale is a [block_rows] vector broadcast over
        # the group: the same q.astype(f32) * scale.astype(f32) as kv_formats.unpack,
        # hence bit-identical, without reshapes or value slicing in the kernel.
        gs = fmt.group_size
        for g in range(fmt.scales_per_row):
            q = from_stored(latent_ref[s, rows, pl.ds(g * gs, gs)], fmt.latent_dtype)  # [block_rows, gs]
            scale = from_stored(scale_ref[s, rows, g], fmt.scale_dtype)  # [block_rows]
            x = q.astype(jnp.float32) * scale.astype(jnp.float32)[:, None]
            latent_out_ref[:, pl.ds(g * gs, gs)] = x.astype(latent_out_ref.dtype)
    else:
        latent = from_stored(latent_ref[s, rows, :], fmt.latent_dtype)  # [block_rows, 512]
        latent_out_ref[...] = latent.astype(latent_out_ref.dtype)
    rope = from_stored(rope_ref[s, rows, :], fmt.rope_dtype)  # [block_rows, 64]
    rope_out_ref[...] = rope.astype(rope_out_ref.dtype)


def _validate_blocks(positions, block_rows: int):
    if not _is_pow2(block_rows):
        raise ValueError(f"block_rows must be a power of two, got {block_rows}")
    if positions.ndim == 2 and positions.shape[1] % block_rows:
        raise ValueError(
            f"the number of selected rows M={positions.shape[1]} must be a multiple of " f"block_rows={block_rows}"
        )


def _validate_planes(planes, plane_of_lane, positions, fmt: KVFormat, *, compiled: bool):
    expected = {"latent", "rope"} | ({"scale"} if fmt.quantised else set())
    if set(planes) != expected:
        raise ValueError(f"KV format {fmt.name!r} needs planes {sorted(expected)}, got {sorted(planes)}")
    if positions.ndim != 2 or not jnp.issubdtype(positions.dtype, jnp.integer):
        # float positions were truncated to int32 silently
        raise ValueError(f"positions must be int[S, M], got {positions.dtype}{list(positions.shape)}")
    S = positions.shape[0]
    if plane_of_lane.shape != (S,) or not jnp.issubdtype(plane_of_lane.dtype, jnp.integer):
        raise ValueError(f"plane_of_lane must be int[S={S}] (one plane per lane of positions), got "
                         f"{plane_of_lane.dtype}{list(plane_of_lane.shape)}")
    if planes["latent"].ndim != 3:
        raise ValueError(f"planes must be [P, N, W], got latent {list(planes['latent'].shape)}")
    P, N = planes["latent"].shape[:2]
    shapes = fmt.plane_shapes(P, N)
    for name, (shape, dtype) in shapes.items():
        p = planes[name]
        if p.shape != shape or p.dtype != dtype:
            raise ValueError(
                f"plane {name!r} of format {fmt.name!r} must be {dtype}{list(shape)} "
                f"([P, N, W] like the latent plane), got {p.dtype}{list(p.shape)}"
            )
        if not _is_pow2(shape[-1] * dtype.itemsize):
            raise ValueError(
                f"plane {name!r} row width {shape[-1]} x {dtype.itemsize} B "
                "is not a power of two (Triton lowering needs one)"
            )
    # The reference reads flat row plane * N + position (int32); the kernel's offsets are the lowering's, 64-bit
    # past 2**32 bytes (kernels_pallas.hot_gather: addressing).
    check_addressable(planes, "history", compiled=compiled)


@functools.partial(jax.jit, static_argnames=("kv_format", "out_dtype", "block_rows", "interpret"))
def gather_rows(
    planes: dict[str, jax.Array],
    plane_of_lane: jax.Array,
    positions: jax.Array,
    *,
    kv_format: str,
    out_dtype=jnp.bfloat16,
    block_rows: int = 16,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Gathers ``planes[*][plane_of_lane[s], positions[s, m]]`` and dequantises to ``out_dtype``.

    Args:
      planes: dict of ``[P, N, W]`` planes in ``kv_format`` (see kernels_pallas.kv_formats). A caller passes every
        layer's and slot's planes stacked ([L*S, N, W], a free reshape) and reads each lane's rows in place: a
        sliced or gathered operand would make XLA copy those planes' whole history before the custom call.
      plane_of_lane: int32[S], the plane each lane (row of ``positions``) reads, in [0, P).
      positions: int32[S, M], each in [0, N); M a multiple of ``block_rows`` (``ops.gather_rows`` pads). S or
        M = 0 gives empty outputs.
      kv_format: format name.
      out_dtype: dtype of the outputs.
      block_rows: rows per program (power of two).
      interpret: run the Pallas interpreter (CPU tests).

    Returns:
      ``(latent[S, M, 512], rope[S, M, 64])`` in ``out_dtype``.
    """
    fmt = kv_formats.get_format(kv_format)
    _validate_planes(planes, plane_of_lane, positions, fmt, compiled=not interpret)
    _validate_blocks(positions, block_rows)
    S, M = positions.shape
    out_dtype = jnp.dtype(out_dtype)
    if S * M == 0:  # a grid of zero programs does not lower
        return (jnp.zeros((S, M, kv_formats.LATENT_DIM), out_dtype), jnp.zeros((S, M, kv_formats.ROPE_DIM), out_dtype))
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    operands = [plane_of_lane.astype(jnp.int32), positions.astype(jnp.int32), planes["latent"]]
    if fmt.quantised:
        operands.append(planes["scale"])
    operands.append(planes["rope"])
    kernel = functools.partial(_gather_rows_kernel, fmt=fmt, block_rows=block_rows)
    return pl.pallas_call(
        kernel,
        grid=(S, M // block_rows),
        in_specs=[any_spec] * len(operands),
        out_specs=[
            pl.BlockSpec((None, block_rows, kv_formats.LATENT_DIM), lambda s, j: (s, j, 0)),
            pl.BlockSpec((None, block_rows, kv_formats.ROPE_DIM), lambda s, j: (s, j, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((S, M, kv_formats.LATENT_DIM), out_dtype),
            jax.ShapeDtypeStruct((S, M, kv_formats.ROPE_DIM), out_dtype),
        ],
        # Triton params: the Triton lowering is also the one that runs on ROCm.
        # No loops in the body, so a single stage; ignored by the interpreter.
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name=f"gather_rows_{fmt.name}",
    )(*operands)


@functools.partial(jax.jit, static_argnames=("kv_format", "out_dtype", "block_rows", "interpret"))
def gather_rows_reference(
    planes: dict[str, jax.Array],
    plane_of_lane: jax.Array,
    positions: jax.Array,
    *,
    kv_format: str,
    out_dtype=jnp.bfloat16,
    block_rows: int = 16,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Pure-jnp ``gather_rows``: one ``take_rows`` per plane of rows ``plane * N + position`` of the planes
    flattened to ``[P * N, W]`` (a free reshape; taking each lane's plane first would copy whole planes), then
    ``kv_formats.unpack``."""
    del block_rows, interpret  # Same signature as the kernel.
    fmt = kv_formats.get_format(kv_format)
    _validate_planes(planes, plane_of_lane, positions, fmt, compiled=False)
    P, N = planes["latent"].shape[:2]
    flat_row = plane_of_lane.astype(jnp.int32)[:, None] * N + jnp.clip(positions.astype(jnp.int32), 0, N - 1)
    rows = {k: take_rows(v.reshape(P * N, v.shape[-1]), flat_row, axis=0) for k, v in planes.items()}
    return kv_formats.unpack(fmt, rows, out_dtype)
