"""Hot gather: each selected KV row from the recent ring, a hot-cache slot (hit) or host memory (miss).

The article's final design ("let the GPU manage the hot cache directly"): the DSA selection never leaves the
device; one kernel reads every selected row from wherever it is and writes the compact rows attention consumes.
Misses are read straight from the ``pinned_host`` history planes, zero-copy over PCIe (measured to work with
Pallas's Triton lowering and ``memory_space=ANY`` operands: h200-probe.md).

The kernel writes each row twice: dequantised (``latent``, ``rope`` in the model's dtype, what attention reads,
with the same arithmetic as ``kv_formats.unpack`` and the resident ``gather_rows``) and, for misses only, packed (the
raw plane bytes, what the fill step copies into victim slots: a dequantised row cannot be re-packed to the same
bytes). Each program issues all its loads before any store, so a miss's round trips overlap. Dequantising
here instead of in a separate XLA op saved one kernel per layer per step, ~2 us each on the H200 (profile_decode).

Each entry's source is decided before the kernel (``source``: 0 ring, 1 hot, 2 host) together with its row in that
source's flat ``[rows, W]`` plane. Loads are masked per source, so a hit never touches host memory and a miss never
touches the hot cache.

Addressing (what the kernels here can reach, and why): Pallas' Triton lowering turns an indexed load or store of a
``memory_space=ANY`` operand into ``tt.addptr(base, offsets)`` with *element* offsets ``sum(index_d * stride_d)``
(``_compute_offsets_from_indices`` in jax/_src/pallas/triton/lowering.py: lines 1890-1980 in JAX 0.10.2, 1888-1978
on jax-ml/jax main at cec06d1, 0.11.1). The offsets are i64 only when the whole operand is larger than 2**32 *bytes*
(``offset_eltype = ... 64 if full_size > 2**32 else 32``, line 1909 / 1907), else i32, which Triton adds to the
pointer as a signed number. Indices are widened to the offset type zero-extended (``_ir_cast(index, offset_eltype,
signed=False)``, line 1960 / 1958, is ``arith.extui`` in ``_int_int_cast``, line 1589 / 1587), so an int32 index
is read as unsigned: indices must never be negative (masked-off lanes here point at row 0 or one past the end).
Hence, with int32 row indices everywhere (XLA glue and kernels):

* an operand of more than 2**32 bytes is addressed in 64 bits, however far its rows reach: the host pool's int8
  latent plane at 16 sessions x 1,048,576 rows x 9 layers is 151M rows, 77 GB; its byte offsets reach 7.7e10
  while its row indices stay below 2**31 (``tests/test_pool_scale.py`` checks the lowering at that size);
* an operand of at most 2**32 bytes with fewer than 2**31 elements has every offset below 2**31;
* an operand of 2**31..2**32 one-byte elements (int8 / fp8 latent planes of 2.1-4.3 GB) gets i32 offsets past
  2**31 that wrap negative: misaddressed (illegal memory accesses on the H200). The caches give such planes
  padding rows that nothing addresses, past 2**32 bytes (``glm53.cache.addressable_planes``; the host pool whole
  pages, ``glm53.memory.allocated_pages``), and the compiled kernels refuse them (``check_addressable``);
* a plane has fewer than 2**31 rows, so its row indices and the one-past-the-end row of masked stores are int32
  (``check_addressable``; ``glm53.offload.validate`` refuses caches that would need more).

The interpreter (CPU tests) lowers the same loads to XLA gathers, which address any array in 64 bits.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas import kv_formats
from kernels_pallas.index_math import take_rows
from kernels_pallas.kv_formats import KVFormat, from_stored

RING, HOT, HOST = 0, 1, 2
# Launch shape: 4 rows per program and one warp, i.e. 512 programs for a 2,048-row round, which keeps the most host
# rows in flight over PCIe. On the H200 2,048 misses took 40.0 us against 46.6 us at 16 rows x 4 warps, hits alike
# (experiments/results/hot_gather_sweep.json, ``experiments.bench_hot_gather --sweep``). Timed again by device time
# (hot_gather_sweep_15cb82b.json): a 10-lane decode layer (20,480 rows, 99% hits, slots in fill order) 14.0 us here,
# 13.3-14.0 at 4 rows x 4 warps, 14.4-14.7 at 8 x 4, 15.5-16.4 at 16 x 4, 33-38 at 16 x 1; the resident gather of the
# same positions 18.1. Two things that did not help (hot_gather_branch_pad*_5471ae4.json): a host plane past 2**32
# bytes, addressed in 64 bits, times as the 32-bit one (14.1 / 14.0 us); and loading the host source only in blocks
# that hold a miss (a branch per block) gained nothing at 4 x 4 and lost ~1-2 us at 4 x 1.
DEFAULT_BLOCK_ROWS = 4
DEFAULT_NUM_WARPS = 1


def _is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


# Row indices are int32 and a masked-off store points one past the last row: a plane holds fewer than 2**31 rows.
MAX_PLANE_ROWS = 2**31 - 1


def triton_misaddressed(shape, dtype) -> bool:
    """Whether Pallas' Triton lowering addresses an operand of this shape and dtype wrongly: 2**31 or more elements
    in at most 2**32 bytes get i32 element offsets past 2**31, added as negative numbers (see the module doc)."""
    elements = math.prod(shape)
    return elements >= 2**31 and elements * jnp.dtype(dtype).itemsize <= 2**32


def check_addressable(planes: dict, what: str, *, compiled: bool) -> None:
    """Refuse planes the kernels cannot address: ``[rows, ...]`` planes of 2**31 rows or more (int32 row indices),
    and, for the compiled kernels, operands in the range the Triton lowering misaddresses."""
    for name, plane in planes.items():
        rows = math.prod(plane.shape[:-1]) if plane.ndim > 1 else plane.shape[0]
        if rows > MAX_PLANE_ROWS:
            raise ValueError(f"{what} plane {name!r} {plane.dtype}{list(plane.shape)} has {rows:,} rows: row indices "
                             f"are int32, so a plane holds at most {MAX_PLANE_ROWS:,}")
        if compiled and triton_misaddressed(plane.shape, plane.dtype):
            elements = math.prod(plane.shape)
            raise ValueError(f"{what} plane {name!r} {plane.dtype}{list(plane.shape)}: {elements:,} elements in "
                             f"{elements * jnp.dtype(plane.dtype).itemsize:,} bytes; Pallas' Triton lowering "
                             "addresses 2**31..2**32 one-byte elements with negative 32-bit offsets (allocate it "
                             "past 2**32 bytes with padding rows: glm53.cache.padded_rows, "
                             "glm53.memory.allocated_pages)")


def _load3(srcs, masks, row, cols, dtype):
    """The rows ``row`` at columns ``cols`` from whichever of the three sources each entry's mask selects."""
    value = None
    for src_ref, m in zip(srcs, masks):
        # Masked-off lanes issue no memory access; their row index is pinned to 0 so addresses stay in range, and
        # their value is never used (the select below takes each entry from its own source). Planes are stored as
        # integers or f32 (kv_formats.stored_dtype), so the fill value 0 lowers for every format: fp8 planes, for
        # which the Triton lowering has no constant, are uint8 here.
        part = plgpu.load(src_ref.at[jnp.where(m, row, 0)[:, None], cols], mask=m[:, None], other=0)
        value = part if value is None else jnp.where(m[:, None], part, value)
    return value.astype(dtype)


def _store_where(ref, value, rows_mask):
    plgpu.store(ref, value, mask=jnp.broadcast_to(rows_mask, value.shape))


def _hot_gather_kernel(source_ref, row_ref, *refs, fmt: KVFormat, names: tuple, block_rows: int):
    """One program gathers ``block_rows`` entries.

    Refs (ANY = the whole array where it lives; flat planes, sorted by plane name):
      source_ref: [E] int32, ANY — 0 ring, 1 hot, 2 host
      row_ref:    [E] int32, ANY — row within that source's plane
      then per plane: ring_ref [R_total, W_p], hot_ref [H_total, W_p], host_ref [N_host, W_p] (ANY)
      outputs: latent_out [block_rows, 512], rope_out [block_rows, 64], then per plane packed_out [block_rows, W_p]
      (written at host entries only)
    Planes hold their format's values as stored (``kv_formats.stored_dtype``): bitcast back before the arithmetic,
    moved as they are.
    """
    n = len(names)
    srcs = {name: refs[3 * i: 3 * i + 3] for i, name in enumerate(names)}
    latent_out, rope_out = refs[3 * n], refs[3 * n + 1]
    packed_out = dict(zip(names, refs[3 * n + 2:]))
    i = pl.program_id(0)
    source = source_ref[pl.ds(i * block_rows, block_rows)]  # [block_rows]
    row = row_ref[pl.ds(i * block_rows, block_rows)]
    masks = [source == s for s in (RING, HOT, HOST)]
    cols = {n: jnp.arange(packed_out[n].shape[1], dtype=jnp.int32)[None, :] for n in names}
    # Every load before any store: a miss is a PCIe round trip, and loads issued back to back wait for their round
    # trips together, where a store between two loads may keep the second from issuing until the first returned.
    latent = _load3(srcs["latent"], masks, row, cols["latent"], packed_out["latent"].dtype)  # [block, 512]
    rope = _load3(srcs["rope"], masks, row, cols["rope"], packed_out["rope"].dtype)
    if fmt.quantised:
        scale = _load3(srcs["scale"], masks, row, cols["scale"], packed_out["scale"].dtype)  # [block, G], as stored
        # Each latent column's group scale, broadcast from the [block, G] tile just loaded: the same
        # q.astype(f32) * scale.astype(f32) as kv_formats.unpack, hence bit-identical. The scale used to be loaded
        # a second time at latent width (column c reading scale c // group_size): 512 scalar loads a row, which
        # Triton cannot vectorise, issued three times (one per source) where a row's latent takes 32 vector loads.
        # A decode step's layer as the engine lays it out took 31.4 us against 35.4 (H200, bench_hot_gather
        # --insitu, hot_gather_8f038d6*.json).
        per_group = (block_rows, fmt.scales_per_row, fmt.group_size)
        scale_values = from_stored(scale, fmt.scale_dtype)
        scale_per_col = jnp.broadcast_to(scale_values[:, :fmt.scales_per_row, None], per_group).reshape(
            block_rows, kv_formats.LATENT_DIM)  # [block, 512]
    # Packed rows only for misses: the fill installs nothing else (hits are in the hot cache already, ring rows
    # reach the host through the copyback). Storing every entry's 656 packed bytes beside its 1,152 dequantised ones
    # wrote 13 MB more a layer at 10 lanes x 2,048 rows; 38.3 -> 32.8 us with the load order above (H200).
    miss = masks[HOST][:, None]
    _store_where(packed_out["latent"], latent, miss)
    _store_where(packed_out["rope"], rope, miss)
    rope_out[...] = from_stored(rope, fmt.rope_dtype).astype(rope_out.dtype)
    latent_values = from_stored(latent, fmt.latent_dtype)
    if fmt.quantised:
        _store_where(packed_out["scale"], scale, miss)
        x = latent_values.astype(jnp.float32) * scale_per_col.astype(jnp.float32)
        latent_out[...] = x.astype(latent_out.dtype)
    else:
        latent_out[...] = latent_values.astype(latent_out.dtype)


def _validate(source, row, ring, hot, host, block_rows, fmt: KVFormat, *, compiled: bool):
    if not _is_pow2(block_rows):
        raise ValueError(f"block_rows must be a power of two, got {block_rows}")
    if source.shape != row.shape or source.ndim != 1:
        raise ValueError(f"source and row must be matching 1-D arrays, got {source.shape} and {row.shape}")
    for a, what in ((source, "source"), (row, "row")):
        # Cast to int32 by the kernel: float rows would be truncated, bool sources read as ring / hot.
        if not jnp.issubdtype(a.dtype, jnp.integer):
            raise ValueError(f"{what} must be an integer array, got {a.dtype}")
    if source.shape[0] % block_rows:
        raise ValueError(f"the number of entries {source.shape[0]} must be a multiple of block_rows={block_rows}")
    if not (ring.keys() == hot.keys() == host.keys()):
        raise ValueError(f"ring, hot and host planes differ: {sorted(ring)}, {sorted(hot)}, {sorted(host)}")
    expected = {"latent", "rope"} | ({"scale"} if fmt.quantised else set())
    if set(ring) != expected:
        raise ValueError(f"KV format {fmt.name!r} needs planes {sorted(expected)}, got {sorted(ring)}")
    # Checked against the format, not only against each other: a plane of another width failed as a broadcast deep
    # in the kernel, and one of another dtype was dequantised as if it were the format's.
    for name, (shape, dtype) in fmt.plane_shapes(1).items():
        for what, planes in (("ring", ring), ("hot", hot), ("host", host)):
            p = planes[name]
            if p.ndim != 2 or p.shape[1] != shape[1] or p.dtype != dtype:
                raise ValueError(f"{what} plane {name!r} of format {fmt.name!r} must be flat "
                                 f"{dtype}[rows, {shape[1]}], got {p.dtype}{list(p.shape)}")
        if not _is_pow2(shape[1] * dtype.itemsize):
            raise ValueError(f"plane {name!r}: width {shape[1]} must be a power of two (Triton lowering)")
    for what, planes in (("ring", ring), ("hot", hot), ("host", host)):
        check_addressable(planes, what, compiled=compiled)


@functools.partial(jax.jit, static_argnames=("kv_format", "out_dtype", "block_rows", "num_warps", "interpret"))
def hot_gather(source: jax.Array, row: jax.Array, ring: dict, hot: dict, host: dict, *, kv_format: str,
               out_dtype=jnp.bfloat16, block_rows: int = DEFAULT_BLOCK_ROWS,
               num_warps: int = DEFAULT_NUM_WARPS,
               interpret: bool = False) -> tuple[jax.Array, jax.Array, dict]:
    """Gather entries ``e`` of ``source``/``row`` (``[E]``) from the flat ``[rows, W]`` planes of the ring, the
    hot cache and host memory (all in ``kv_format``). Returns ``(latent [E, 512], rope [E, 64], packed)``:
    the rows dequantised to ``out_dtype`` and ``{plane: [E, W]}`` the same rows as stored, **defined at host
    entries (misses) only**: what the fill installs; other rows of ``packed`` are unspecified (``packed_at_misses``
    compares them).

    ``source``: int32 ``[E]``, each ``RING`` (0), ``HOT`` (1) or ``HOST`` (2); ``row``: int32 ``[E]``, the row of
    that source's plane, in [0, its rows). E a multiple of ``block_rows`` (``ops.hot_gather`` pads); E = 0 gives
    empty outputs. Another source or a row out of range is the caller's bug: that entry's outputs are undefined
    (the kernel reads nothing for an unknown source and outside the plane for such a row; the reference returns
    other rows, so the two differ there)."""
    fmt = kv_formats.get_format(kv_format)
    _validate(source, row, ring, hot, host, block_rows, fmt, compiled=not interpret)
    names = tuple(sorted(ring))
    E = source.shape[0]
    out_dtype = jnp.dtype(out_dtype)
    if E == 0:  # a grid of zero programs does not lower
        return (jnp.zeros((0, kv_formats.LATENT_DIM), out_dtype), jnp.zeros((0, kv_formats.ROPE_DIM), out_dtype),
                {n: jnp.zeros((0, ring[n].shape[1]), ring[n].dtype) for n in names})
    operands, in_specs = [source, row], [pl.BlockSpec(memory_space=pl.ANY)] * 2
    for name in names:
        operands += [ring[name], hot[name], host[name]]
        in_specs += [pl.BlockSpec(memory_space=pl.ANY)] * 3
    out_shape = [jax.ShapeDtypeStruct((E, kv_formats.LATENT_DIM), out_dtype),
                 jax.ShapeDtypeStruct((E, kv_formats.ROPE_DIM), out_dtype)]
    out_shape += [jax.ShapeDtypeStruct((E, ring[n].shape[1]), ring[n].dtype) for n in names]
    out_specs = [pl.BlockSpec((block_rows, s.shape[1]), lambda i: (i, 0)) for s in out_shape]
    kwargs = {} if interpret else {"compiler_params": plgpu.CompilerParams(num_warps=num_warps, num_stages=1)}
    latent, rope, *packed = pl.pallas_call(
        functools.partial(_hot_gather_kernel, fmt=fmt, names=names, block_rows=block_rows),
        out_shape=out_shape, grid=(E // block_rows,), in_specs=in_specs, out_specs=out_specs,
        interpret=interpret, name="glm53_hot_gather", **kwargs,
    )(*operands)
    return latent, rope, dict(zip(names, packed))


def packed_at_misses(packed: dict, source: jax.Array) -> dict:
    """``packed`` with every entry that is not a miss zeroed: the part of ``hot_gather``'s packed output it
    defines, comparable between the kernel and the reference."""
    miss = (source == HOST)[:, None]
    return {n: jnp.where(miss, v, jnp.zeros((), v.dtype)) for n, v in packed.items()}


def hot_gather_reference(source: jax.Array, row: jax.Array, ring: dict, hot: dict, host: dict, *, kv_format: str,
                         out_dtype=jnp.bfloat16, block_rows: int = DEFAULT_BLOCK_ROWS,
                         num_warps: int = DEFAULT_NUM_WARPS,
                         interpret: bool = False) -> tuple[jax.Array, jax.Array, dict]:
    """Pure-jnp reference with the same signature. ``host`` planes must be readable by XLA's gather here (device
    arrays; a caller holding ``pinned_host`` planes moves them first — the CPU fallback does). Its packed rows are
    zero where the kernel's are unspecified (every entry but a miss), so a consumer that read them would change
    results on the CPU too, not only on a GPU."""
    del num_warps, interpret
    fmt = kv_formats.get_format(kv_format)
    _validate(source, row, ring, hot, host, block_rows, fmt, compiled=False)
    packed = {}
    for name in ring:
        vals = [take_rows(src[name], jnp.where(source == s, row, 0), axis=0)
                for s, src in ((RING, ring), (HOT, hot), (HOST, host))]
        sel = source[:, None]
        packed[name] = jnp.where(sel == RING, vals[0], jnp.where(sel == HOT, vals[1], vals[2]))
    latent, rope = kv_formats.unpack(fmt, packed, out_dtype)
    return latent, rope, packed_at_misses(packed, source)
