"""Fill: copy a round's missed rows into their victim hot-cache slots, in place, for several layers at once.

The offload fill (``fill_round``) knows, per layer and lane, how many rows it installs (``n_fill``), which gathered
entry each comes from (``entry``) and which slot it goes to (``victim``). Its size is static (up to one fill per
gathered entry) but the real count is small at high hit rates (~20 of 2,048 rows at 99% hits). An XLA scatter
processes every static entry and reads the whole gathered buffer per plane: about 20 us per decode step on the H200
for 8 layers (profile_decode). Here the work follows the real fills: each (layer, lane) has a few programs
(``programs_per_lane``) that read its ``n_fill`` and copy its blocks of ``block_rows`` fills round-robin, in a loop
whose trip count is read at run time.

One program per block of the static F instead (the first version) made the work follow the fills too, but the grid
did not: 9 layers x 10 lanes x 128 blocks = 11,520 programs, ~5 waves of the H200's resident blocks, each a memory
round trip to read ``n_fill`` and return; 7.1 us of a 10-lane decode step (profile_decode at 7c8b9f2), nearly all of
it launching programs that copy nothing. With 8 programs per lane the grid is one wave, and a round of up to
8 x 16 fills (the common case; ~20 at 99% hits) is one iteration; a cold round of 2,048 fills takes 16.

The gathered rows stay where the hot gather wrote them, one array per layer (``rows[i]``), each of its own width:
stacking them would copy every gathered row once more, and padding them to one width did as much (the MTP layer's
round of an MTP-3 verify step is its 3 drafts' 6,144 entries a lane beside the main layers' 8,192: padding it cost
pad fusions of ~57 us a 10-lane step on the H200, ``experiments/results/probes/mtp3_verify_profile_ba64033.json``).
Lane b writes the hot rows of session slot ``lane_slot[b]``, read at run time.
The hot planes are aliased input -> output (donated by the caller's jit, so the update is in place).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas.hot_gather import check_addressable


def _fill_kernel(entry_ref, victim_ref, n_fill_ref, lane_slot_ref, *refs, layers: tuple, names: tuple,
                 sessions: int, entries: tuple, hot_rows: int, block_rows: int, programs_per_lane: int):
    """Program (i, b, j) copies the fill blocks j, j + G, j + 2G, ... (G = ``programs_per_lane``, a block is
    ``block_rows`` fills) of layer ``layers[i]``, lane b (session slot ``lane_slot[b]``), up to ``n_fill[i, b]``.

    Refs (all ANY):
      entry_ref, victim_ref: [Lp, B, F] int32; n_fill_ref: [Lp, B] int32; lane_slot_ref: [B] int32
      rows: per layer i, per plane: [B * entries[i], W] — the round's gathered packed rows
      hot (aliased inputs, unused), then hot outputs: per plane [L * sessions * hot_rows + pad, W]
    One grid axis per layer keeps reading the count a single memory round trip (looping over the layers inside a
    program chained one per layer: 13 us for 8 layers, measured).
    """
    n_planes = len(names)
    row_refs = refs[: len(layers) * n_planes]
    hot_out = refs[len(layers) * n_planes + n_planes:]
    li, b, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    # A count past the F fills listed would read entry / victim past this lane's lists (the next lane's, or past the
    # arrays) and store there; the reference copies F. The interpreter clamps such reads, so only GPUs differed.
    n = jnp.minimum(n_fill_ref[li, b], entry_ref.shape[2])
    stride = programs_per_lane * block_rows
    trips = jnp.maximum(n - j * block_rows + stride - 1, 0) // stride  # blocks of this program below n
    for i, layer in enumerate(layers):
        # The rows of each layer are a separate operand, so the layer is dispatched statically.
        @pl.when((li == i) & (trips > 0))
        def _copy():
            ref_rows = [row_refs[i * n_planes + p] for p in range(n_planes)]
            first_row = (layer * sessions + lane_slot_ref[b]) * hot_rows

            def copy_block(t, carry):
                start = (j + t * programs_per_lane) * block_rows
                k = start + jnp.arange(block_rows, dtype=jnp.int32)
                mask = k < n
                entry = entry_ref[i, b, pl.ds(start, block_rows)]
                victim = victim_ref[i, b, pl.ds(start, block_rows)]
                src = b * entries[i] + jnp.where(mask, entry, 0)
                for p in range(n_planes):
                    # Masked-off rows point past the end (planes may differ in padding rows:
                    # glm53.cache.addressable_planes). GPUs skip them anyway, but the Pallas interpreter writes
                    # every row (the old value where masked), which at an in-range dummy row could undo a real fill.
                    dst = jnp.where(mask, first_row + victim, hot_out[p].shape[0])
                    cols = jnp.arange(hot_out[p].shape[1], dtype=jnp.int32)[None, :]
                    ref = ref_rows[p]
                    # Masked-off rows are never stored, so they need no fill value; the Triton lowering has no
                    # constant of an fp8 type to fill them with (fp8g128 failed to compile on the H200).
                    fp8 = jnp.issubdtype(ref.dtype, jnp.floating) and jnp.finfo(ref.dtype).bits == 8
                    val = plgpu.load(ref.at[src[:, None], cols], mask=mask[:, None], other=None if fp8 else 0)
                    plgpu.store(hot_out[p].at[dst[:, None], cols], val, mask=mask[:, None])
                return carry

            jax.lax.fori_loop(0, trips, copy_block, jnp.int32(0))


def _validate(hot, rows, layers, entry, victim, n_fill, lane_slot, sessions, hot_rows, block_rows, *,
              compiled: bool):
    if block_rows <= 0 or block_rows & (block_rows - 1):
        raise ValueError(f"block_rows must be a power of two, got {block_rows}")
    if lane_slot.ndim != 1 or not jnp.issubdtype(lane_slot.dtype, jnp.integer):
        raise ValueError(f"lane_slot must be int[B], got {lane_slot.dtype}{list(lane_slot.shape)}")
    B = lane_slot.shape[0]
    Lp = len(layers)
    if len(rows) != Lp or entry.shape != victim.shape or entry.ndim != 3 or entry.shape[:2] != (Lp, B):
        raise ValueError(f"{Lp} layers and {B} lanes need {Lp} row dicts and entry/victim [{Lp}, {B}, F]; got "
                         f"{len(rows)}, {entry.shape}, {victim.shape}")
    if n_fill.shape != (Lp, B):
        raise ValueError(f"n_fill must be [{Lp}, {B}], got {n_fill.shape}")
    for a, what in ((entry, "entry"), (victim, "victim"), (n_fill, "n_fill")):
        # The kernel casts to int32 (truncating floats) where the reference's gather refuses or compares as floats.
        if not jnp.issubdtype(a.dtype, jnp.integer):
            raise ValueError(f"{what} must be an integer array, got {a.dtype}")
    if entry.shape[2] % block_rows:
        raise ValueError(f"F={entry.shape[2]} must be a multiple of block_rows={block_rows}")
    for n, plane in hot.items():
        # Rows past the slots' are padding (so the plane stays addressable: glm53.cache.addressable_planes).
        if plane.ndim != 2 or plane.shape[0] < (max(layers, default=0) + 1) * sessions * hot_rows:
            raise ValueError(f"hot plane {n!r} must be [L * sessions * hot_rows + pad, W] with sessions={sessions}, "
                             f"hot_rows={hot_rows} and L > {max(layers, default=0)}; got {plane.shape}")
    for r in rows:
        if r.keys() != hot.keys():
            raise ValueError(f"row planes {sorted(r)} differ from hot planes {sorted(hot)}")
        for n in hot:
            if r[n].shape[1:] != hot[n].shape[1:] or r[n].dtype != hot[n].dtype or (r[n].shape[0] % B if B else
                                                                                     r[n].shape[0]):
                raise ValueError(f"plane {n!r}: rows {r[n].dtype}{r[n].shape} do not match hot "
                                 f"{hot[n].dtype}{hot[n].shape} ([B * E, W] with B={B} lanes)")
    # Destination rows (layer * sessions + slot) * hot_rows + victim are int32 (kernels_pallas.hot_gather:
    # addressing).
    check_addressable(hot, "hot", compiled=compiled)
    for r in rows:
        check_addressable(r, "rows", compiled=compiled)


@functools.partial(jax.jit, static_argnames=("layers", "sessions", "hot_rows", "block_rows", "programs_per_lane",
                                             "num_warps", "interpret"), donate_argnames=("hot",))
def fill_rows(hot: dict, rows: tuple, entry: jax.Array, victim: jax.Array, n_fill: jax.Array, lane_slot: jax.Array,
              *, layers: tuple, sessions: int, hot_rows: int, block_rows: int = 16, programs_per_lane: int = 8,
              num_warps: int = 4, interpret: bool = False) -> dict:
    """``hot[plane][(layers[i] * sessions + lane_slot[b]) * hot_rows + victim[i, b, f]] = rows[i][plane][b * E_i +
    entry[i, b, f]]`` for ``f < min(n_fill[i, b], F)``. ``hot``: flat ``[L * sessions * hot_rows + pad, W]`` planes
    (``sessions`` is the number of session slots S; ``pad`` rows, never written, may differ per plane); ``rows[i]``:
    flat ``[B * E_i, W]`` planes, one row block per lane, E_i entries a lane (layers may differ). Inactive lanes
    have n_fill 0 (``fill_round``) and so copy nothing. Returns the updated hot planes (in place).

    ``entry``, ``victim``: int32 ``[len(layers), B, F]``, F a multiple of ``block_rows``; ``n_fill``: int32
    ``[len(layers), B]``. Only the first ``min(n_fill, F)`` fills of a lane are read; each of them needs ``entry``
    in [0, E_i), ``victim`` in [0, hot_rows) and distinct within its (layer, lane), and ``lane_slot[b]`` in
    [0, sessions): otherwise the result is undefined (kernel and reference may write different rows, the kernel
    outside its lane's slots). F = 0 or B = 0 copies nothing."""
    _validate(hot, rows, layers, entry, victim, n_fill, lane_slot, sessions, hot_rows, block_rows,
              compiled=not interpret)
    if programs_per_lane < 1:
        raise ValueError(f"programs_per_lane must be positive, got {programs_per_lane}")
    if not entry.size:  # no fills listed (or no lanes): a grid of zero programs does not lower
        return dict(hot)
    names = tuple(sorted(hot))
    B = lane_slot.shape[0]
    entries = tuple(r[names[0]].shape[0] // B for r in rows)
    F = entry.shape[2]
    G = min(programs_per_lane, F // block_rows)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    operands = [entry.astype(jnp.int32), victim.astype(jnp.int32), n_fill.astype(jnp.int32),
                lane_slot.astype(jnp.int32)]
    for r in rows:
        operands += [r[n] for n in names]
    first_hot = len(operands)
    operands += [hot[n] for n in names]
    kwargs = {} if interpret else {"compiler_params": plgpu.CompilerParams(num_warps=num_warps, num_stages=1)}
    out = pl.pallas_call(
        functools.partial(_fill_kernel, layers=layers, names=names, sessions=sessions, entries=entries,
                          hot_rows=hot_rows, block_rows=block_rows, programs_per_lane=G),
        out_shape=[jax.ShapeDtypeStruct(hot[n].shape, hot[n].dtype) for n in names],
        grid=(len(layers), B, G),
        in_specs=[any_spec] * len(operands), out_specs=[any_spec] * len(names),
        input_output_aliases={first_hot + p: p for p in range(len(names))},
        interpret=interpret, name="glm53_fill_rows", **kwargs,
    )(*operands)
    return dict(zip(names, out))


@functools.partial(jax.jit, static_argnames=("layers", "sessions", "hot_rows", "block_rows", "programs_per_lane",
                                             "num_warps", "interpret"), donate_argnames=("hot",))
def fill_rows_reference(hot: dict, rows: tuple, entry: jax.Array, victim: jax.Array, n_fill: jax.Array,
                        lane_slot: jax.Array, *, layers: tuple, sessions: int, hot_rows: int, block_rows: int = 16,
                        programs_per_lane: int = 8, num_warps: int = 4, interpret: bool = False) -> dict:
    """Pure-jnp ``fill_rows``: one scatter per plane over every static fill (the ones past n_fill dropped)."""
    del num_warps, interpret, programs_per_lane
    _validate(hot, rows, layers, entry, victim, n_fill, lane_slot, sessions, hot_rows, block_rows, compiled=False)
    if not entry.size:  # as the kernel
        return dict(hot)
    Lp, B, F = entry.shape
    do = jnp.arange(F)[None, None, :] < n_fill[..., None]
    b = jnp.arange(B)[:, None]
    slot = lane_slot.astype(jnp.int32)[None, :, None]
    dst = (jnp.asarray(layers, jnp.int32)[:, None, None] * sessions + slot) * hot_rows + victim
    out = {}
    for n, plane in hot.items():
        dst_n = jnp.where(do, dst, plane.shape[0])  # out of range: dropped
        # each layer's rows have their own entries a lane (E_i)
        vals = jnp.stack([jnp.take(r[n], (b * (r[n].shape[0] // B) + jnp.where(do[i], entry[i], 0)).reshape(-1),
                                   axis=0) for i, r in enumerate(rows)])  # [Lp, B * F, W]
        out[n] = plane.at[dst_n.reshape(-1)].set(vals.reshape(Lp * B * F, -1), mode="drop")
    return out
