"""Pallas gather of selected KV-cache rows with in-kernel dequantisation.

Layout follows jax/experimental/pallas/ops/gpu: kernel body, wrapper, public op,
pure-jnp reference with the same signature.

The cache planes (see ``kernels_pallas.kv_formats``) and the positions are passed with
``memory_space=pl.ANY``: the kernel gets raw pointers and reads only the selected
rows straight from wherever the arrays live. That is what lets the same kernel
read ``pinned_host`` planes zero-copy over PCIe on the GPU (h200-probe.md); a
blocked spec would make Pallas/XLA stage whole blocks instead. Outputs are
ordinary blocked specs, one ``[block_rows, W]`` tile per program.

Positions must lie in [0, N). Callers clamp; an out-of-range position is the
caller's bug: the kernel would read outside the plane (undefined), while the
reference clamps (``jnp.take(mode="clip")``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas import kv_formats
from kernels_pallas.kv_formats import KVFormat


def _is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def _gather_rows_kernel(pos_ref, latent_ref, *refs, fmt: KVFormat, block_rows: int, first_plane: int):
    """One program gathers ``block_rows`` rows of one session.

    Refs (ANY = whole array in place; outputs have the session dim squeezed):
      pos_ref:        [S, M] int32, ANY
      latent_ref:     [P, N, 512] latent dtype, ANY (session s reads plane first_plane + s)
      scale_ref:      [P, N, G] scale dtype, ANY (quantised formats only)
      rope_ref:       [P, N, 64] rope dtype, ANY
      latent_out_ref: [block_rows, 512] out dtype
      rope_out_ref:   [block_rows, 64] out dtype
    """
    if fmt.quantised:
        scale_ref, rope_ref, latent_out_ref, rope_out_ref = refs
    else:
        scale_ref = None
        rope_ref, latent_out_ref, rope_out_ref = refs
    j = pl.program_id(1)
    rows = pos_ref[pl.program_id(0), pl.ds(j * block_rows, block_rows)]  # [block_rows]
    s = pl.program_id(0) + first_plane
    # A 3-D ref indexed by (scalar session, row vector, slice) lowers on Triton to
    # one pointer tensor [block_rows, width] (64-bit offsets once the plane exceeds
    # 4 GiB), and to a gather in interpret mode; no flattening to [S*N, W] needed.
    if fmt.quantised:
        # One group at a time, so the scale is a [block_rows] vector broadcast over
        # the group: the same q.astype(f32) * scale.astype(f32) as kv_formats.unpack,
        # hence bit-identical, without reshapes or value slicing in the kernel.
        gs = fmt.group_size
        for g in range(fmt.scales_per_row):
            q = latent_ref[s, rows, pl.ds(g * gs, gs)]  # [block_rows, gs]
            scale = scale_ref[s, rows, g]  # [block_rows]
            x = q.astype(jnp.float32) * scale.astype(jnp.float32)[:, None]
            latent_out_ref[:, pl.ds(g * gs, gs)] = x.astype(latent_out_ref.dtype)
    else:
        latent = latent_ref[s, rows, :]  # [block_rows, 512]
        latent_out_ref[...] = latent.astype(latent_out_ref.dtype)
    rope = rope_ref[s, rows, :]  # [block_rows, 64]
    rope_out_ref[...] = rope.astype(rope_out_ref.dtype)


def _validate_blocks(positions, block_rows: int):
    if not _is_pow2(block_rows):
        raise ValueError(f"block_rows must be a power of two, got {block_rows}")
    if positions.ndim == 2 and positions.shape[1] % block_rows:
        raise ValueError(
            f"the number of selected rows M={positions.shape[1]} must be a multiple of " f"block_rows={block_rows}"
        )


def _validate_planes(planes, positions, fmt: KVFormat, first_plane: int = 0):
    expected = {"latent", "rope"} | ({"scale"} if fmt.quantised else set())
    if set(planes) != expected:
        raise ValueError(f"KV format {fmt.name!r} needs planes {sorted(expected)}, got {sorted(planes)}")
    if positions.ndim != 2:
        raise ValueError(f"positions must be [S, M], got shape {positions.shape}")
    S = positions.shape[0]
    P = planes["latent"].shape[0]
    if first_plane < 0 or first_plane + S > P:
        raise ValueError(f"sessions [{first_plane}, {first_plane + S}) are outside the planes' {P} sessions")
    shapes = fmt.plane_shapes(P, planes["latent"].shape[1])
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


@functools.partial(jax.jit, static_argnames=("kv_format", "out_dtype", "block_rows", "interpret", "first_plane"))
def gather_rows(
    planes: dict[str, jax.Array],
    positions: jax.Array,
    *,
    kv_format: str,
    out_dtype=jnp.bfloat16,
    block_rows: int = 16,
    interpret: bool = False,
    first_plane: int = 0,
) -> tuple[jax.Array, jax.Array]:
    """Gathers ``planes[*][first_plane + s, positions[s, m]]`` and dequantises to ``out_dtype``.

    Args:
      planes: dict of ``[P, N, W]`` planes in ``kv_format`` (see kernels_pallas.kv_formats), P >= first_plane + S. The
        offset lets a caller pass every layer's planes stacked ([L*B, N, W], a free reshape) and read one layer's
        rows in place: a sliced operand would make XLA copy that layer's whole history before the custom call.
      positions: int32[S, M], each in [0, N); M a multiple of ``block_rows``.
      kv_format: format name.
      out_dtype: dtype of the outputs.
      block_rows: rows per program (power of two).
      interpret: run the Pallas interpreter (CPU tests).
      first_plane: plane of session 0 (static).

    Returns:
      ``(latent[S, M, 512], rope[S, M, 64])`` in ``out_dtype``.
    """
    fmt = kv_formats.get_format(kv_format)
    _validate_planes(planes, positions, fmt, first_plane)
    _validate_blocks(positions, block_rows)
    S, M = positions.shape
    out_dtype = jnp.dtype(out_dtype)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    operands = [positions.astype(jnp.int32), planes["latent"]]
    if fmt.quantised:
        operands.append(planes["scale"])
    operands.append(planes["rope"])
    kernel = functools.partial(_gather_rows_kernel, fmt=fmt, block_rows=block_rows, first_plane=first_plane)
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


@functools.partial(jax.jit, static_argnames=("kv_format", "out_dtype", "block_rows", "interpret", "first_plane"))
def gather_rows_reference(
    planes: dict[str, jax.Array],
    positions: jax.Array,
    *,
    kv_format: str,
    out_dtype=jnp.bfloat16,
    block_rows: int = 16,
    interpret: bool = False,
    first_plane: int = 0,
) -> tuple[jax.Array, jax.Array]:
    """Pure-jnp ``gather_rows``: ``jnp.take`` per plane, then ``kv_formats.unpack``."""
    del block_rows, interpret  # Same signature as the kernel.
    fmt = kv_formats.get_format(kv_format)
    _validate_planes(planes, positions, fmt, first_plane)
    S = positions.shape[0]
    take = jax.vmap(lambda p, i: jnp.take(p, i, axis=0, mode="clip"))
    rows = {k: take(v[first_plane:first_plane + S], positions.astype(jnp.int32)) for k, v in planes.items()}
    return kv_formats.unpack(fmt, rows, out_dtype)
