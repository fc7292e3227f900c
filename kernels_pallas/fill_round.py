"""Fill bookkeeping of one offload round for several layers at once: pins, victims, slot maps, clock, counters.

After a round's hot gather (``hot_gather``) every layer knows, per selected position, its source (ring / hot hit /
host miss) and, for hits, its slot. The fill then installs the misses into victim slots for later rounds:

  1. pin: every slot read as a hit gets this round's stamp (``pin_round = rounds + 1``), so it is not a victim;
  2. victims: the first unpinned slots in circular order from ``clock``, inside a window of ``W = min(H, M + F)``
     slots (a round pins at most M slots, so the window always holds F unpinned ones);
  3. pairing: the k-th missed position (in selection order; positions are distinct) goes to the k-th victim, for
     ``k < n_fill = min(misses, free slots, F)``;
  4. maps: the victim's old position leaves ``slot_of_position`` (eviction), the new one enters, and
     ``position_of_slot[victim]`` is the new position; ``clock`` moves past the last victim; ``rounds`` advances;
     counters add hits, misses, ring reads, fills and evictions.

The rows themselves are copied by ``fill_rows`` from the ``entry`` / ``victim`` / ``n_fill`` this op returns.

In XLA this was ~15 small kernels per decode step (cumsums, five scatters, stacks, dynamic-update-slices): about 33 us
of a 4.4 ms step on the H200, most of it per-kernel overhead (experiments.profile_decode at 39fb5e6). Here one
program per (layer, session) does it all: 16.9 us per step in the decode profile (9a24c79), and 19.2 us against
the reference's 32.4 us for 9 layers in ``experiments.bench_fill_round`` (num_warps 8; 4-32 warps time alike, so
it is bound by the chain of dependent memory round trips below, not by lanes). Steps 1-2 and 3-4 communicate
through memory (the pins written by some lanes are read by others; so are the rank-compacted entries and victims),
hence the two block barriers; a program touches only its own (layer, session) state, so programs never race.

``fill_round_reference`` is the same function in jnp, and also handles rounds whose positions may repeat (prefill
chunks, ``distinct=False``: the first occurrence of each missed position is filled once); the kernel needs decode
rounds (``distinct=True``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas.hot_gather import HOST, HOT

MAP_NAMES = ("pin_round", "position_of_slot", "slot_of_position", "rounds", "clock", "counters")
NUM_COUNTERS = 5  # hits, misses, ring reads, fills, evictions


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def sizes(num_positions: int, hot_rows: int) -> tuple[int, int]:
    """(F, W): the most fills one round can make, and the window of slots searched for victims."""
    F = min(num_positions, hot_rows)
    return F, min(hot_rows, num_positions + F)


def _validate(maps: dict, rounds: tuple, layers: tuple, hot_rows: int):
    if tuple(sorted(maps)) != tuple(sorted(MAP_NAMES)):
        raise ValueError(f"maps must hold {sorted(MAP_NAMES)}, got {sorted(maps)}")
    L, B, H = maps["pin_round"].shape
    if H != hot_rows or maps["position_of_slot"].shape != (L, B, H):
        raise ValueError(f"pin_round / position_of_slot must be [L, B, hot_rows={hot_rows}], got "
                         f"{maps['pin_round'].shape} / {maps['position_of_slot'].shape}")
    if maps["slot_of_position"].shape[:2] != (L, B) or maps["slot_of_position"].ndim != 3:
        raise ValueError(f"slot_of_position must be [{L}, {B}, N], got {maps['slot_of_position'].shape}")
    if maps["rounds"].shape != (L, B) or maps["clock"].shape != (L, B):
        raise ValueError(f"rounds / clock must be [{L}, {B}], got {maps['rounds'].shape} / {maps['clock'].shape}")
    if maps["counters"].shape != (L, B, NUM_COUNTERS):
        raise ValueError(f"counters must be [{L}, {B}, {NUM_COUNTERS}], got {maps['counters'].shape}")
    if len(rounds) != len(layers) or not layers:
        raise ValueError(f"one round per layer: {len(rounds)} rounds for layers {layers}")
    if len(set(layers)) != len(layers) or not all(0 <= l < L for l in layers):
        raise ValueError(f"layers {layers} must be distinct and in [0, {L})")
    for r in rounds:
        if tuple(sorted(r)) != ("pos", "slot", "source", "valid"):
            raise ValueError(f"a round holds pos, source, slot, valid; got {sorted(r)}")
        shapes = {k: tuple(v.shape) for k, v in r.items()}
        if len(set(shapes.values())) != 1 or shapes["pos"][0] != B or len(shapes["pos"]) != 2:
            raise ValueError(f"round arrays must all be [{B}, M], got {shapes}")
        if shapes["pos"] != tuple(rounds[0]["pos"].shape):
            raise ValueError("every layer's round must select the same number of positions")


def _scatter(ref, idx, val, mask):
    """Masked store to flat ``ref[idx]``. Masked-off lanes point past the end: on GPUs they touch no memory either
    way, but the Pallas interpreter writes every lane (the old value where masked), so an in-range dummy address
    could overwrite a real store to the same element."""
    plgpu.store(ref.at[jnp.where(mask, idx, ref.shape[0])], val, mask=mask)


def _round_kernel(*refs, layers: tuple, sessions: int, hot_rows: int, positions: int, capacity: int,
                  padded: tuple, interpret: bool):
    """Program (i, b): the round of layer ``layers[i]``, session b.

    Refs (all ANY): per layer i: pos, source, slot ([B, Mp] int32), valid ([B, Mp] bool); the six maps (aliased
    inputs, unused: their outputs are the same buffers); outputs: the six maps, flat ([L * B * H], [L * B * H],
    [L * B * N], [L * B], [L * B], [L * B * 5]), then entry and victim ([Lp * B * Fp]) and n_fill ([Lp * B]).
    """
    Mp, Fp, Wp = padded
    H, B, N = hot_rows, sessions, capacity
    F, W = sizes(positions, hot_rows)
    n_layers = len(layers)
    round_refs = refs[: 4 * n_layers]
    pin, pos_of_slot, slot_of_pos, rounds, clock, counters, entry_o, victim_o, n_fill_o = refs[4 * n_layers + 6:]
    li, b = pl.program_id(0), pl.program_id(1)

    def barrier():
        if not interpret:  # the interpreter runs a program's lanes as one array program: nothing to order
            plgpu.debug_barrier()

    def one_round(i: int, layer: int):
        pos_ref, src_ref, slot_ref, valid_ref = round_refs[4 * i: 4 * i + 4]
        lb = layer * B + b
        this_round = rounds[lb] + 1
        start = clock[lb]
        m = jnp.arange(Mp, dtype=jnp.int32)
        src = src_ref[b, pl.ds(0, Mp)]
        slot = slot_ref[b, pl.ds(0, Mp)]
        valid = valid_ref[b, pl.ds(0, Mp)]
        is_hit, is_miss = src == HOT, src == HOST
        # 1. pins: the slots this round read as hits
        _scatter(pin, lb * H + slot, jnp.full((Mp,), this_round, jnp.int32), is_hit)
        barrier()
        # 2. free slots of the window, in circular order from the clock
        w = jnp.arange(Wp, dtype=jnp.int32)
        in_window = w < W
        slot_at = (start + w) % H
        stamp = plgpu.load(pin.at[lb * H + slot_at], mask=in_window, other=this_round)
        free_at = in_window & (stamp != this_round)
        # 3. ranks: the k-th missed position pairs with the k-th free slot
        first = (is_miss & valid).astype(jnp.int32)
        free = free_at.astype(jnp.int32)
        miss_rank = jnp.cumsum(first) - 1
        free_rank = jnp.cumsum(free) - 1
        n_fill = jnp.minimum(jnp.minimum(jnp.sum(first), jnp.sum(free)), F)
        base = (i * B + b) * Fp
        _scatter(entry_o, base + miss_rank, m, (first == 1) & (miss_rank < F))
        _scatter(victim_o, base + free_rank, slot_at, free_at & (free_rank < F))
        barrier()
        # 4. install: maps, then the normalised entry / victim lists the row copy reads
        k = jnp.arange(Fp, dtype=jnp.int32)
        do = k < n_fill
        entry = plgpu.load(entry_o.at[base + k], mask=do, other=0)
        victim = plgpu.load(victim_o.at[base + k], mask=do, other=H)
        safe_victim = jnp.where(do, victim, 0)
        new_pos = plgpu.load(pos_ref.at[b, entry], mask=do, other=0)
        old_pos = plgpu.load(pos_of_slot.at[lb * H + safe_victim], mask=do, other=-1)
        evicted = do & (old_pos >= 0)
        _scatter(pos_of_slot, lb * H + safe_victim, new_pos, do)
        _scatter(slot_of_pos, lb * N + old_pos, jnp.full((Fp,), -1, jnp.int32), evicted)
        _scatter(slot_of_pos, lb * N + new_pos, safe_victim, do)
        plgpu.store(entry_o.at[base + k], entry)
        plgpu.store(victim_o.at[base + k], victim)
        last_victim = jnp.sum(jnp.where(k == n_fill - 1, victim, 0))
        rounds[lb] = this_round
        clock[lb] = jnp.where(n_fill > 0, (last_victim + 1) % H, start)
        n_fill_o[i * B + b] = n_fill
        tally = (jnp.sum((is_hit & valid).astype(jnp.int32)), jnp.sum((is_miss & valid).astype(jnp.int32)),
                 jnp.sum((~is_hit & ~is_miss & valid).astype(jnp.int32)), n_fill,
                 jnp.sum(evicted.astype(jnp.int32)))
        c = jnp.arange(8, dtype=jnp.int32)
        add = jnp.zeros((8,), jnp.int32)
        for j, t in enumerate(tally):
            add = jnp.where(c == j, t, add)
        ok = c < NUM_COUNTERS
        before = plgpu.load(counters.at[lb * NUM_COUNTERS + jnp.where(ok, c, 0)], mask=ok, other=0)
        _scatter(counters, lb * NUM_COUNTERS + c, before + add, ok)

    for i, layer in enumerate(layers):
        # Each layer's round is a separate operand (stacking them would be one more copy), so the layer is
        # dispatched statically.
        pl.when(li == i)(functools.partial(one_round, i, layer))


@functools.partial(jax.jit, static_argnames=("layers", "hot_rows", "distinct", "num_warps", "interpret"),
                   donate_argnames=("maps",))
def fill_round(maps: dict, rounds: tuple, *, layers: tuple, hot_rows: int, distinct: bool = True,
               num_warps: int = 8, interpret: bool = False):
    """One fill for the rounds of ``layers`` (``rounds[i]`` is layer ``layers[i]``'s: ``pos``, ``source``,
    ``slot`` int32 and ``valid`` bool, each ``[B, M]``). ``maps``: ``pin_round``, ``position_of_slot`` [L, B, H],
    ``slot_of_position`` [L, B, N], ``rounds``, ``clock`` [L, B], ``counters`` [L, B, 5], updated in place.

    Returns ``(maps, entry, victim, n_fill)``: fill f < n_fill[i, b] of layer i, session b copies gathered entry
    ``entry[i, b, f]`` into slot ``victim[i, b, f]``; past n_fill, entry is 0 and victim is H."""
    _validate(maps, rounds, layers, hot_rows)
    if not distinct:
        raise ValueError("the fill kernel handles decode rounds (distinct positions); use fill_round_reference")
    L, B, H = maps["pin_round"].shape
    N = maps["slot_of_position"].shape[2]
    M = rounds[0]["pos"].shape[1]
    F, W = sizes(M, H)
    Mp, Fp, Wp = _next_pow2(M), _next_pow2(F), _next_pow2(W)
    Lp = len(layers)
    operands = []
    for r in rounds:
        for name in ("pos", "source", "slot", "valid"):
            # valid stays bool: converting it would be one more small kernel per layer and step
            a = r[name].astype(bool if name == "valid" else jnp.int32)
            if Mp != M:  # padded positions: no source, not valid (never hit, missed or counted)
                a = jnp.pad(a, ((0, 0), (0, Mp - M)), constant_values=-1 if name == "source" else 0)
            operands.append(a)
    first_map = len(operands)
    operands += [maps[n].reshape(-1) for n in MAP_NAMES]
    out_shape = [jax.ShapeDtypeStruct((maps[n].size,), jnp.int32) for n in MAP_NAMES]
    out_shape += [jax.ShapeDtypeStruct((Lp * B * Fp,), jnp.int32)] * 2 + [jax.ShapeDtypeStruct((Lp * B,), jnp.int32)]
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    kwargs = {} if interpret else {"compiler_params": plgpu.CompilerParams(num_warps=num_warps, num_stages=1)}
    out = pl.pallas_call(
        functools.partial(_round_kernel, layers=layers, sessions=B, hot_rows=H, positions=M, capacity=N,
                          padded=(Mp, Fp, Wp), interpret=interpret),
        out_shape=out_shape,
        grid=(Lp, B),
        in_specs=[any_spec] * len(operands), out_specs=[any_spec] * len(out_shape),
        input_output_aliases={first_map + j: j for j in range(len(MAP_NAMES))},
        interpret=interpret, name="glm53_fill_round", **kwargs,
    )(*operands)
    new_maps = {n: out[j].reshape(maps[n].shape) for j, n in enumerate(MAP_NAMES)}
    entry = out[-3].reshape(Lp, B, Fp)[..., :F]
    victim = out[-2].reshape(Lp, B, Fp)[..., :F]
    return new_maps, entry, victim, out[-1].reshape(Lp, B)


def _layer_index(layers: tuple):
    """A static slice when the layers are consecutive (always, for the model's rounds): XLA updates a slice in
    place with a dynamic-update-slice, where an index array makes a scatter."""
    if list(layers) == list(range(layers[0], layers[0] + len(layers))):
        return slice(layers[0], layers[0] + len(layers))
    return jnp.asarray(layers, jnp.int32)


@functools.partial(jax.jit, static_argnames=("layers", "hot_rows", "distinct", "num_warps", "interpret"),
                   donate_argnames=("maps",))
def fill_round_reference(maps: dict, rounds: tuple, *, layers: tuple, hot_rows: int, distinct: bool = True,
                         num_warps: int = 8, interpret: bool = False):
    """Pure-jnp ``fill_round``; with ``distinct=False`` a position selected several times in a round (by
    different tokens of a prefill chunk) is filled once, from its first entry."""
    del num_warps, interpret
    _validate(maps, rounds, layers, hot_rows)
    lidx = _layer_index(layers)
    pos, source, slot, valid = (jnp.stack([r[k] for r in rounds]).astype(jnp.int32 if k != "valid" else bool)
                                for k in ("pos", "source", "slot", "valid"))
    Lp, B, M = pos.shape
    N = maps["slot_of_position"].shape[2]
    H = hot_rows
    F, W = sizes(M, H)
    is_hit, is_miss = source == HOT, source == HOST
    l_m = jnp.broadcast_to(jnp.asarray(layers, jnp.int32)[:, None, None], (Lp, B, M))
    b_m = jnp.broadcast_to(jnp.arange(B)[None, :, None], (Lp, B, M))
    this_round = maps["rounds"][lidx] + 1  # [Lp, B]
    pin_round = maps["pin_round"].at[l_m, b_m, jnp.where(is_hit, slot, H)].set(
        jnp.broadcast_to(this_round[..., None], (Lp, B, M)), mode="drop")
    clock = maps["clock"][lidx]
    slot_at = (clock[..., None] + jnp.arange(W, dtype=jnp.int32)) % H  # slots in circular order from the clock
    free_at = jnp.take_along_axis(pin_round[lidx], slot_at, axis=2) != this_round[..., None]

    def per_session(pos, is_miss, valid, clock, slot_at, free_at, pos_of_slot):
        wanted = is_miss & valid
        if distinct:
            first, order = wanted, jnp.arange(M, dtype=jnp.int32)
        else:
            key = jnp.where(wanted, pos, N)
            order = jnp.argsort(key, stable=True).astype(jnp.int32)
            skey = key[order]
            first = (skey < N) & jnp.concatenate([jnp.ones((1,), bool), skey[1:] != skey[:-1]])
        # One cumsum ranks both the unique misses and the free slots (the second part is offset by the first's
        # total): one scan kernel instead of two.
        ranks = jnp.cumsum(jnp.concatenate([first, free_at]).astype(jnp.int32))
        n_unique = ranks[M - 1]
        n_free = ranks[-1] - n_unique
        unique_entry = jnp.zeros((F,), jnp.int32).at[jnp.where(first, ranks[:M] - 1, F)].set(order, mode="drop")
        victim_of_rank = jnp.full((F,), H, jnp.int32).at[
            jnp.where(free_at, ranks[M:] - n_unique - 1, F)].set(slot_at, mode="drop")
        n_fill = jnp.minimum(jnp.minimum(n_unique, n_free), F)
        do = jnp.arange(F) < n_fill
        victim = jnp.where(do, victim_of_rank, H)
        entry = jnp.where(do, unique_entry, 0)
        new_pos = jnp.where(do, pos[entry], N)
        old_pos = jnp.where(do, pos_of_slot[jnp.minimum(victim, H - 1)], -1)
        new_clock = jnp.where(n_fill > 0, (victim_of_rank[jnp.maximum(n_fill - 1, 0)] + 1) % H, clock)
        return victim, entry, new_pos, old_pos, new_clock, n_fill

    victim, entry, new_pos, old_pos, new_clock, n_fill = jax.vmap(jax.vmap(per_session))(
        pos, is_miss, valid, clock, slot_at, free_at, maps["position_of_slot"][lidx])
    # The evicted positions must be read before position_of_slot is updated in place. Left to itself XLA fused that
    # read into the slot_of_position scatter, scheduled it after the update and so copied the whole map twice per
    # step to keep the old values (seen in the compiled HLO); the barrier orders the read first, with no copy.
    old_pos, pos_of_slot_before = jax.lax.optimization_barrier((old_pos, maps["position_of_slot"]))
    # Every counter in one reduction (each separate one was a ~1-2 us kernel of 8 short rows).
    evicted = jnp.pad(old_pos >= 0, ((0, 0), (0, 0), (0, M - F)))
    indicators = jnp.stack([is_hit & valid, is_miss & valid, ~is_hit & ~is_miss & valid, evicted], axis=2)
    tally = indicators.astype(jnp.int32).sum(-1)  # [Lp, B, 4]: hits, misses, ring reads, evictions
    counts = jnp.concatenate([tally[..., :3], n_fill[..., None], tally[..., 3:]], axis=-1)
    l_idx = jnp.broadcast_to(jnp.asarray(layers, jnp.int32)[:, None, None], victim.shape)
    b_idx = jnp.broadcast_to(jnp.arange(B)[None, :, None], victim.shape)
    # Evictions and fills in one scatter: evicted positions were hot and filled ones were not, so the two sets are
    # disjoint and their order does not matter.
    slot_of_position = maps["slot_of_position"].at[
        jnp.concatenate([l_idx, l_idx], -1), jnp.concatenate([b_idx, b_idx], -1),
        jnp.concatenate([jnp.where(old_pos >= 0, old_pos, N), new_pos], -1)].set(
        jnp.concatenate([jnp.full_like(victim, -1), victim], -1), mode="drop")
    position_of_slot = pos_of_slot_before.at[l_idx, b_idx, victim].set(new_pos, mode="drop")
    new_maps = dict(pin_round=pin_round, position_of_slot=position_of_slot, slot_of_position=slot_of_position,
                    rounds=maps["rounds"].at[lidx].set(this_round), clock=maps["clock"].at[lidx].set(new_clock),
                    counters=maps["counters"].at[lidx].add(counts))
    return new_maps, entry, victim, n_fill
