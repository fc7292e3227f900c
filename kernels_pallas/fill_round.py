"""Fill bookkeeping of one offload round for several layers at once: pins, victims, slot maps, clock, counters.

After a round's hot gather (``hot_gather``) every layer knows, per selected position, its source (ring / hot hit /
host miss) and, for hits, its slot. The fill then installs the misses into victim slots for later rounds:

  1. pin: every slot read as a hit gets this round's stamp (``pin_round = rounds + 1``), so it is not a victim;
  2. victims: the first unpinned slots in circular order from ``clock``, inside a window of ``W = min(H, M + F)``
     slots (a round pins at most M slots, so the window always holds F unpinned ones);
  3. pairing: the k-th missed position (in entry order; a position several entries missed counts once, at its
     first entry) goes to the k-th victim, for ``k < n_fill = min(missed positions, free slots, F)``;
  4. maps: the victim's old position leaves ``slot_of_position`` (eviction), the new one enters, and
     ``position_of_slot[victim]`` is the new position; ``clock`` moves past the last victim; ``rounds`` advances;
     counters add hits, misses, ring reads, fills and evictions.

The rows themselves are copied by ``fill_rows`` from the ``entry`` / ``victim`` / ``n_fill`` this op returns.

In XLA this was ~15 small kernels per decode step (cumsums, five scatters, stacks, dynamic-update-slices): about 33 us
of a 4.4 ms step on the H200, most of it per-kernel overhead (experiments.profile_decode at 39fb5e6). Here one
program per (layer, lane) does it all: 16.9 us per step in the decode profile (9a24c79), and 19.2 us against
the reference's 32.4 us for 9 layers in ``experiments.bench_fill_round`` (num_warps 8; 4-32 warps time alike, so
it is bound by the chain of dependent memory round trips below, not by lanes). Steps 1-2 and 3-4 communicate
through memory (the pins written by some lanes are read by others; so are the rank-compacted entries and victims),
hence the two block barriers; a program touches only its own (layer, slot) state, so programs never race.

Two paths, chosen per program at run time. A warm cache misses a few entries a round: with at most C of them
(``compact_sizes``: a quarter of the round, at most 1,024), they are compacted first (one scan of the round) and
every later step works on C-wide vectors: the election, the ranks, the install; the victims come from the window
Wc slots at a time, only as far as the fills need. Otherwise (a cold cache, a low hit rate) every step works on the
whole round and window. Both give the same result. An MTP-3 verify step's round is 4 rows (8,192 entries) and its
window 16,384 slots: the full path took 94.3 us a step there against 17.3 for a decode step
(``experiments/results/probes/mtp3_verify_profile_ba64033.json``), its time growing with the vector widths.

Lanes: the maps hold every session slot (``[L, S, ...]``); program (i, b) works on slot ``lane_slot[b]``, read at run
time, so one compiled step serves any lane -> slot map. Active lanes never share a slot; an inactive (padding) lane
may carry any slot, also an active lane's, and writes nothing but its empty fill list.

Repeated positions (``distinct=False``: MTP verify rows or drafts of one session selecting the same missing
position) are filled once, from their first entry. The kernel elects those entries without atomics (which the Pallas
interpreter cannot discharge when masked): ``slot_of_position`` is -1 at every missed position, so it serves as
scratch where entries store their index, read back, and the lower ones try again, ``max_repeats`` times; then it is
restored. ``fill_round_reference`` is the same function in jnp (a stable sort finds the first entries).

``slot_of_position`` is int16 when the hot cache has at most 32,768 slots (the design's 2 bytes per position:
``glm53.offload.slot_map_dtype``), else int32; the other maps are int32. Slots (< hot_rows), the -1 sentinel and the
election's scratch codes (-2 - entry index, >= -2 - 16,383 for the kernel's rounds of at most 16,384 positions) all
fit either; every value is computed in int32 and cast only where it is stored.
"""

from __future__ import annotations

import functools
import numbers

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas import index_math as im
from kernels_pallas.hot_gather import HOST, HOT, check_addressable

MAP_NAMES = ("pin_round", "position_of_slot", "slot_of_position", "rounds", "clock", "counters")
NUM_COUNTERS = 5  # hits, misses, ring reads, fills, evictions
SLOT_MAP_DTYPES = (jnp.int16, jnp.int32)  # slot_of_position's; the other maps are int32


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def sizes(num_positions: int, hot_rows: int) -> tuple[int, int]:
    """(F, W): the most fills one round can make, and the window of slots searched for victims."""
    F = min(num_positions, hot_rows)
    return F, min(hot_rows, num_positions + F)


MAX_COMPACT = 1024


def compact_sizes(padded_positions: int, padded_window: int) -> tuple[int, int]:
    """(C, Wc): a round with at most C wanted entries (misses) takes the kernel's compacted path, which searches
    the victim window Wc slots at a time. C is a quarter of the round (at least 1), at most 1,024: a decode round of
    2,048 positions compacts up to 512 misses (75% hits), an MTP-3 verify round of 8,192 up to 1,024; a cold cache
    takes the full path."""
    C = min(MAX_COMPACT, max(padded_positions // 4, 1))
    return C, min(padded_window, 2 * C)


def _validate(maps: dict, rounds: tuple, lane_slot, lane_active, layers: tuple, hot_rows: int, max_repeats: int):
    if tuple(sorted(maps)) != tuple(sorted(MAP_NAMES)):
        raise ValueError(f"maps must hold {sorted(MAP_NAMES)}, got {sorted(maps)}")
    if maps["pin_round"].ndim != 3:
        raise ValueError(f"pin_round must be [L, S, hot_rows], got {maps['pin_round'].shape}")
    L, S, H = maps["pin_round"].shape
    if H != hot_rows or maps["position_of_slot"].shape != (L, S, H):
        raise ValueError(f"pin_round / position_of_slot must be [L, S, hot_rows={hot_rows}], got "
                         f"{maps['pin_round'].shape} / {maps['position_of_slot'].shape}")
    if maps["slot_of_position"].shape[:2] != (L, S) or maps["slot_of_position"].ndim != 3:
        raise ValueError(f"slot_of_position must be [{L}, {S}, N], got {maps['slot_of_position'].shape}")
    slot_dtype = jnp.dtype(maps["slot_of_position"].dtype)
    if slot_dtype not in [jnp.dtype(d) for d in SLOT_MAP_DTYPES] or hot_rows - 1 > jnp.iinfo(slot_dtype).max:
        raise ValueError(f"slot_of_position must be int16 or int32 and hold slots up to hot_rows - 1 = "
                         f"{hot_rows - 1}, got {slot_dtype}")
    for n in MAP_NAMES:
        if n != "slot_of_position" and jnp.dtype(maps[n].dtype) != jnp.int32:
            raise ValueError(f"{n} must be int32, got {maps[n].dtype}")
    # The kernel addresses the maps flat ((layer * S + slot) * N + position, int32), with a one-past-the-end row for
    # masked stores: each map holds fewer than 2**31 elements.
    check_addressable({n: jax.ShapeDtypeStruct((maps[n].size,), maps[n].dtype) for n in MAP_NAMES}, "map",
                      compiled=False)
    if maps["rounds"].shape != (L, S) or maps["clock"].shape != (L, S):
        raise ValueError(f"rounds / clock must be [{L}, {S}], got {maps['rounds'].shape} / {maps['clock'].shape}")
    if maps["counters"].shape != (L, S, NUM_COUNTERS):
        raise ValueError(f"counters must be [{L}, {S}, {NUM_COUNTERS}], got {maps['counters'].shape}")
    if len(rounds) != len(layers) or not layers:
        raise ValueError(f"one round per layer: {len(rounds)} rounds for layers {layers}")
    if len(set(layers)) != len(layers) or not all(0 <= l < L for l in layers):
        raise ValueError(f"layers {layers} must be distinct and in [0, {L})")
    if lane_slot.ndim != 1 or not jnp.issubdtype(lane_slot.dtype, jnp.integer):
        raise ValueError(f"lane_slot must be int[B], got {lane_slot.dtype}{list(lane_slot.shape)}")
    B = lane_slot.shape[0]
    if lane_active.shape != (B,) or lane_active.dtype != jnp.bool_:
        raise ValueError(f"lane_active must be bool[{B}] like lane_slot, got {lane_active.dtype}"
                         f"{list(lane_active.shape)}")
    for r in rounds:
        if tuple(sorted(r)) != ("pos", "slot", "source", "valid"):
            raise ValueError(f"a round holds pos, source, slot, valid; got {sorted(r)}")
        for k in ("pos", "source", "slot"):  # cast to int32 below: float positions would be truncated silently
            if not jnp.issubdtype(r[k].dtype, jnp.integer):
                raise ValueError(f"a round's {k} must be an integer array, got {r[k].dtype}")
        shapes = {k: tuple(v.shape) for k, v in r.items()}
        if len(set(shapes.values())) != 1 or len(shapes["pos"]) != 2 or shapes["pos"][0] != B:
            raise ValueError(f"round arrays must all be [B={B}, M] (one row per lane), got {shapes}")
        if shapes["pos"] != tuple(rounds[0]["pos"].shape):
            raise ValueError("every layer's round must select the same number of positions")
    if not isinstance(max_repeats, numbers.Integral) or max_repeats < 1:
        raise ValueError(f"max_repeats must be a positive int, got {max_repeats!r}")


def _scatter(ref, idx, val, mask):
    """Masked store to flat ``ref[idx]`` (``val`` cast to the ref's dtype: the slot map may be int16). Masked-off
    lanes point past the end: on GPUs they touch no memory either way, but the Pallas interpreter writes every lane
    (the old value where masked), so an in-range dummy address could overwrite a real store to the same element."""
    plgpu.store(ref.at[jnp.where(mask, idx, ref.shape[0])], val.astype(ref.dtype), mask=mask)


def _round_kernel(*refs, layers: tuple, slots: int, lanes: int, hot_rows: int, positions: int, capacity: int,
                  padded: tuple, distinct: bool, max_repeats: int, interpret: bool):
    """Program (i, b): the round of layer ``layers[i]`` in lane b, on session slot ``lane_slot[b]``.

    Refs (all ANY): per layer i: pos, source, slot ([B, Mp] int32), valid ([B, Mp] bool); lane_slot ([B] int32),
    lane_active ([B] bool); the six maps (aliased inputs, unused: their outputs are the same buffers); outputs: the
    six maps, flat ([L * S * H], [L * S * H], [L * S * N], [L * S], [L * S], [L * S * 5]), then entry and victim
    ([Lp * B * Fp]), n_fill ([Lp * B]) and the compacted wanted entries (scratch, [Lp * B * C]).
    """
    Mp, Fp, Wp, C, Wc = padded
    H, S, B, N = hot_rows, slots, lanes, capacity
    F, W = sizes(positions, hot_rows)
    n_layers = len(layers)
    round_refs = refs[: 4 * n_layers]
    lane_slot_ref, lane_active_ref = refs[4 * n_layers: 4 * n_layers + 2]
    pin, pos_of_slot, slot_of_pos, rounds, clock, counters, entry_o, victim_o, n_fill_o, compact_o = \
        refs[4 * n_layers + 8:]
    li, b = pl.program_id(0), pl.program_id(1)
    k = jnp.arange(Fp, dtype=jnp.int32)
    # Per-lane scalars come from refs: Pallas' Triton lowering has no scalar prefetch.
    active = lane_active_ref[b]

    def barrier():
        if not interpret:  # the interpreter runs a program's lanes as one array program: nothing to order
            plgpu.debug_barrier()

    @pl.when(jnp.logical_not(active))
    def _idle():
        # A padding lane may carry any slot, also one an active lane uses: it must not touch the maps.
        base = (li * B + b) * Fp
        plgpu.store(entry_o.at[base + k], jnp.zeros((Fp,), jnp.int32))
        plgpu.store(victim_o.at[base + k], jnp.full((Fp,), H, jnp.int32))
        n_fill_o[li * B + b] = jnp.int32(0)

    def elect_first(lb, pos, wanted, m):
        """One entry per wanted position, the lowest index ``m`` when max_repeats >= its multiplicity.
        slot_of_position is the scratch (-1 at every wanted position: a miss is not hot), so no atomics are needed
        (the Pallas interpreter cannot discharge masked vector atomics); it is -1 there again on return."""
        code = -2 - m  # never -1 (not hot) nor a slot (>= 0)
        at = lb * N + pos
        cand = wanted
        w = None
        for r in range(max_repeats):
            if r:
                barrier()  # every read of the last round before this round's stores
            # Racing stores to one position leave one of them: the owner of this round. The owner of an earlier
            # round is not a candidate any more (its index is not below itself), so owners only decrease.
            _scatter(slot_of_pos, at, code, cand)
            barrier()
            w = plgpu.load(slot_of_pos.at[jnp.where(wanted, at, 0)], mask=wanted, other=0).astype(jnp.int32)
            cand = cand & (m < -2 - w)
        first = wanted & (w == code)
        barrier()  # every read of the owners before the restore
        _scatter(slot_of_pos, at, jnp.full(m.shape, -1, jnp.int32), wanted)
        return first

    def install(i, b, lb, base, start, this_round, n_fill, size, tally):
        """Step 4 for fills k < n_fill <= size: the maps, then the normalised entry / victim lists the row copy
        reads (entry 0 and victim H past n_fill, up to Fp); rounds, clock and counters."""
        k = jnp.arange(size, dtype=jnp.int32)
        do = k < n_fill
        entry = plgpu.load(entry_o.at[base + k], mask=do, other=0)
        victim = plgpu.load(victim_o.at[base + k], mask=do, other=H)
        safe_victim = jnp.where(do, victim, 0)
        new_pos = plgpu.load(round_refs[4 * i].at[b, entry], mask=do, other=0)
        old_pos = plgpu.load(pos_of_slot.at[lb * H + safe_victim], mask=do, other=-1)
        evicted = do & (old_pos >= 0)
        _scatter(pos_of_slot, lb * H + safe_victim, new_pos, do)
        _scatter(slot_of_pos, lb * N + old_pos, jnp.full((size,), -1, jnp.int32), evicted)
        _scatter(slot_of_pos, lb * N + new_pos, safe_victim, do)
        plgpu.store(entry_o.at[base + k], entry)
        plgpu.store(victim_o.at[base + k], victim)
        for rest in range(size, Fp, size):  # both powers of two: Triton's vectors must be
            plgpu.store(entry_o.at[base + rest + k], jnp.zeros((size,), jnp.int32))
            plgpu.store(victim_o.at[base + rest + k], jnp.full((size,), H, jnp.int32))
        last_victim = jnp.sum(jnp.where(k == n_fill - 1, victim, 0))
        rounds[lb] = this_round
        clock[lb] = jnp.where(n_fill > 0, (last_victim + 1) % H, start)
        n_fill_o[i * B + b] = n_fill
        # misses count every valid entry, repeats included; fills and evictions the real ones
        tally = tally + (n_fill, jnp.sum(evicted.astype(jnp.int32)))
        c = jnp.arange(8, dtype=jnp.int32)
        add = jnp.zeros((8,), jnp.int32)
        for j, t in enumerate(tally):
            add = jnp.where(c == j, t, add)
        ok = c < NUM_COUNTERS
        before = plgpu.load(counters.at[lb * NUM_COUNTERS + jnp.where(ok, c, 0)], mask=ok, other=0)
        _scatter(counters, lb * NUM_COUNTERS + c, before + add, ok)

    def one_round(i: int, layer: int):
        pos_ref, src_ref, slot_ref, valid_ref = round_refs[4 * i: 4 * i + 4]
        lb = layer * S + lane_slot_ref[b]
        this_round = rounds[lb] + 1
        start = clock[lb]
        m = jnp.arange(Mp, dtype=jnp.int32)
        src = src_ref[b, pl.ds(0, Mp)]
        slot = slot_ref[b, pl.ds(0, Mp)]
        valid = valid_ref[b, pl.ds(0, Mp)]
        is_hit, is_miss = src == HOT, src == HOST
        wanted = is_miss & valid
        base = (i * B + b) * Fp
        n_wanted = jnp.sum(wanted.astype(jnp.int32))
        tally = (jnp.sum((is_hit & valid).astype(jnp.int32)), n_wanted,
                 jnp.sum((~is_hit & ~is_miss & valid).astype(jnp.int32)))
        # 1. pins: the slots this round read as hits
        _scatter(pin, lb * H + slot, jnp.full((Mp,), this_round, jnp.int32), is_hit)

        def few_misses():
            """At most C wanted entries (a warm cache): they are compacted first, and everything after works on
            C-wide vectors; the victims come from the window in chunks of Wc slots, as many as the fills need.
            Same result as ``all_entries``: the compacted list keeps entry order."""
            c = jnp.arange(C, dtype=jnp.int32)
            cbase = (i * B + b) * C
            _scatter(compact_o, cbase + jnp.cumsum(wanted.astype(jnp.int32)) - 1, m, wanted)
            barrier()
            live = c < n_wanted
            e = plgpu.load(compact_o.at[cbase + c], mask=live, other=0)  # wanted entries, in entry order
            first = live if distinct else elect_first(lb, plgpu.load(pos_ref.at[b, e], mask=live, other=0), live, e)
            barrier()  # the pins (and the election's restore) before the window reads them
            first = first.astype(jnp.int32)
            miss_rank = jnp.cumsum(first) - 1
            n_first = jnp.sum(first)
            n_need = jnp.minimum(n_first, F)
            _scatter(entry_o, base + miss_rank, e, (first == 1) & (miss_rank < F))

            def more(carry):
                j, found = carry
                return (found < n_need) & (j * Wc < W)

            def chunk(carry):
                j, found = carry
                w = j * Wc + jnp.arange(Wc, dtype=jnp.int32)
                in_window = w < W
                slot_at = (start + w) % H
                stamp = plgpu.load(pin.at[lb * H + jnp.where(in_window, slot_at, 0)], mask=in_window,
                                   other=this_round)
                free = (in_window & (stamp != this_round)).astype(jnp.int32)
                rank = found + jnp.cumsum(free) - 1
                _scatter(victim_o, base + rank, slot_at, (free == 1) & (rank < n_need))
                return j + 1, found + jnp.sum(free)

            _, found = jax.lax.while_loop(more, chunk, (jnp.int32(0), jnp.int32(0)))
            barrier()
            install(i, b, lb, base, start, this_round, jnp.minimum(n_need, found), min(C, Fp), tally)

        def all_entries():
            first = wanted if distinct else elect_first(lb, pos_ref[b, pl.ds(0, Mp)], wanted, m)
            barrier()
            # 2. free slots of the window, in circular order from the clock
            w = jnp.arange(Wp, dtype=jnp.int32)
            in_window = w < W
            slot_at = (start + w) % H
            stamp = plgpu.load(pin.at[lb * H + slot_at], mask=in_window, other=this_round)
            free_at = in_window & (stamp != this_round)
            # 3. ranks: the k-th first miss (in entry order) pairs with the k-th free slot
            first = first.astype(jnp.int32)
            free = free_at.astype(jnp.int32)
            miss_rank = jnp.cumsum(first) - 1
            free_rank = jnp.cumsum(free) - 1
            n_fill = jnp.minimum(jnp.minimum(jnp.sum(first), jnp.sum(free)), F)
            _scatter(entry_o, base + miss_rank, m, (first == 1) & (miss_rank < F))
            _scatter(victim_o, base + free_rank, slot_at, free_at & (free_rank < F))
            barrier()
            install(i, b, lb, base, start, this_round, n_fill, Fp, tally)

        if C < Mp:
            pl.when(n_wanted <= C)(few_misses)
            pl.when(n_wanted > C)(all_entries)
        else:
            all_entries()

    for i, layer in enumerate(layers):
        # Each layer's round is a separate operand (stacking them would be one more copy), so the layer is
        # dispatched statically.
        pl.when((li == i) & active)(functools.partial(one_round, i, layer))


@functools.partial(jax.jit, static_argnames=("layers", "hot_rows", "distinct", "max_repeats", "num_warps",
                                             "interpret"), donate_argnames=("maps",))
def fill_round(maps: dict, rounds: tuple, lane_slot: jax.Array, lane_active: jax.Array, *, layers: tuple,
               hot_rows: int, distinct: bool = True, max_repeats: int = 1, num_warps: int = 8,
               interpret: bool = False):
    """One fill for the rounds of ``layers`` in B lanes (``rounds[i]`` is layer ``layers[i]``'s: ``pos``,
    ``source``, ``slot`` int32 and ``valid`` bool, each ``[B, M]``); lane b works on session slot ``lane_slot[b]``
    and does nothing unless ``lane_active[b]`` (active lanes never share a slot). ``maps``: ``pin_round``,
    ``position_of_slot`` [L, S, H], ``slot_of_position`` [L, S, N] (int16 or int32), ``rounds``, ``clock`` [L, S],
    ``counters`` [L, S, 5] (int32), updated in place.

    ``distinct=False``: a position may be selected by several entries of a round (MTP verify rows, drafts, chunk
    tokens); each is filled once, from its first entry (lowest index). The kernel finds the first entries in
    ``max_repeats`` election rounds, which must be at least the most entries one position has for that rule to hold
    (with fewer, some entry of each position is still chosen, exactly one).

    Index contract (dynamic, so not checked): an active lane's ``lane_slot`` lies in [0, S), its valid entries'
    ``pos`` in [0, N), and its hits' (``source == HOT``) ``slot`` in [0, H), that position's slot in the maps.
    Otherwise the result is undefined: the kernel would write other slots' or layers' maps, the reference drops or
    clamps. A source other than ring, hot or host counts as a ring read in both.

    Returns ``(maps, entry, victim, n_fill)``: fill f < n_fill[i, b] of layer i, lane b copies gathered entry
    ``entry[i, b, f]`` into slot ``victim[i, b, f]``; past n_fill (and for inactive lanes, whose n_fill is 0),
    entry is 0 and victim is H. ``entry`` and ``victim`` are ``[len(layers), B, F]`` with ``F = min(M, H)``
    (``sizes``); a round of M = 0 positions fills nothing but still advances the active lanes' ``rounds``."""
    _validate(maps, rounds, lane_slot, lane_active, layers, hot_rows, max_repeats)
    L, S, H = maps["pin_round"].shape
    N = maps["slot_of_position"].shape[2]
    B, M = rounds[0]["pos"].shape
    F, W = sizes(M, H)
    Lp = len(layers)
    if B == 0:  # a grid of zero programs does not lower
        return (dict(maps), jnp.zeros((Lp, 0, F), jnp.int32), jnp.full((Lp, 0, F), H, jnp.int32),
                jnp.zeros((Lp, 0), jnp.int32))
    Mp, Fp, Wp = _next_pow2(M), _next_pow2(F), _next_pow2(W)
    C, Wc = compact_sizes(Mp, Wp)
    slot_dtype = jnp.dtype(maps["slot_of_position"].dtype)
    if not distinct and -2 - (Mp - 1) < jnp.iinfo(slot_dtype).min:
        raise ValueError(f"rounds of {M} positions (padded to {Mp}) need election codes down to {-1 - Mp}, below "
                         f"{slot_dtype}'s range: use an int32 slot_of_position or the reference")
    operands = []
    for r in rounds:
        for name in ("pos", "source", "slot", "valid"):
            # valid stays bool: converting it would be one more small kernel per layer and step
            a = r[name].astype(bool if name == "valid" else jnp.int32)
            if Mp != M:  # padded positions: no source, not valid (never hit, missed or counted)
                a = jnp.pad(a, ((0, 0), (0, Mp - M)), constant_values=-1 if name == "source" else 0)
            operands.append(a)
    operands += [lane_slot.astype(jnp.int32), lane_active]
    first_map = len(operands)
    operands += [maps[n].reshape(-1) for n in MAP_NAMES]
    out_shape = [jax.ShapeDtypeStruct((maps[n].size,), maps[n].dtype) for n in MAP_NAMES]
    out_shape += [jax.ShapeDtypeStruct((Lp * B * Fp,), jnp.int32)] * 2 + [jax.ShapeDtypeStruct((Lp * B,), jnp.int32)]
    out_shape += [jax.ShapeDtypeStruct((Lp * B * C,), jnp.int32)]
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    kwargs = {} if interpret else {"compiler_params": plgpu.CompilerParams(num_warps=num_warps, num_stages=1)}
    out = pl.pallas_call(
        functools.partial(_round_kernel, layers=layers, slots=S, lanes=B, hot_rows=H, positions=M, capacity=N,
                          padded=(Mp, Fp, Wp, C, Wc), distinct=distinct, max_repeats=max_repeats, interpret=interpret),
        out_shape=out_shape,
        grid=(Lp, B),
        in_specs=[any_spec] * len(operands), out_specs=[any_spec] * len(out_shape),
        input_output_aliases={first_map + j: j for j in range(len(MAP_NAMES))},
        interpret=interpret, name="glm53_fill_round", **kwargs,
    )(*operands)
    new_maps = {n: out[j].reshape(maps[n].shape) for j, n in enumerate(MAP_NAMES)}
    entry = out[-4].reshape(Lp, B, Fp)[..., :F]
    victim = out[-3].reshape(Lp, B, Fp)[..., :F]
    return new_maps, entry, victim, out[-2].reshape(Lp, B)


@functools.partial(jax.jit, static_argnames=("layers", "hot_rows", "distinct", "max_repeats", "num_warps",
                                             "interpret"), donate_argnames=("maps",))
def fill_round_reference(maps: dict, rounds: tuple, lane_slot: jax.Array, lane_active: jax.Array, *,
                         layers: tuple, hot_rows: int, distinct: bool = True, max_repeats: int = 1,
                         num_warps: int = 8, interpret: bool = False, victim_keys: jax.Array | None = None):
    """Pure-jnp ``fill_round``. With ``distinct=False`` each position's first entry (lowest index among its
    valid misses) is the one filled, whatever ``max_repeats`` (the kernel's rule when max_repeats is at least every
    position's multiplicity).

    ``victim_keys`` (``[len(layers), B, H]`` int32; the kernel has no such input): another replacement policy's
    ranking of the lanes' slots, smallest first (ties: lower slot). Victims are then the first unpinned slots in
    that order instead of in circular order from the clock (``glm53.offload``: LFU); the clock still moves past
    the last victim, unused."""
    del num_warps, interpret
    _validate(maps, rounds, lane_slot, lane_active, layers, hot_rows, max_repeats)
    L, S, H = maps["pin_round"].shape
    pos, source, slot, valid = (jnp.stack([r[k] for r in rounds]).astype(jnp.int32 if k != "valid" else bool)
                                for k in ("pos", "source", "slot", "valid"))
    Lp, B, M = pos.shape
    N = maps["slot_of_position"].shape[2]
    F, W = sizes(M, H)
    is_hit, is_miss = source == HOT, source == HOST
    lane_slot = lane_slot.astype(jnp.int32)
    l_b = jnp.broadcast_to(jnp.asarray(layers, jnp.int32)[:, None], (Lp, B))  # [Lp, B]: what each program reads
    s_b = jnp.broadcast_to(lane_slot[None, :], (Lp, B))
    # ... and where it writes: an inactive lane's writes go to slot S, out of range, and are dropped (its slot may
    # be an active lane's).
    w_b = jnp.broadcast_to(jnp.where(lane_active, lane_slot, S)[None, :], (Lp, B))
    l_m, w_m = (jnp.broadcast_to(x[..., None], (Lp, B, M)) for x in (l_b, w_b))
    this_round = maps["rounds"][l_b, s_b] + 1  # [Lp, B]
    pin_round = maps["pin_round"].at[l_m, w_m, jnp.where(is_hit, slot, H)].set(
        jnp.broadcast_to(this_round[..., None], (Lp, B, M)), mode="drop")
    clock = maps["clock"][l_b, s_b]
    if victim_keys is None:
        slot_at = im.rem(clock[..., None] + jnp.arange(W, dtype=jnp.int32), H)  # circular order from the clock
    else:  # the policy's order; a round pins at most M slots, so the first W = M + F hold F unpinned ones
        slot_at = jnp.argsort(victim_keys, axis=-1, stable=True)[..., :W].astype(jnp.int32)
    free_at = jnp.take_along_axis(pin_round[l_b, s_b], slot_at, axis=2) != this_round[..., None]

    def per_lane(pos, is_miss, valid, active, clock, slot_at, free_at, pos_of_slot):
        wanted = is_miss & valid & active
        if distinct:
            first = wanted
        else:
            # A wanted entry is first when no lower index wants the same position: a stable sort groups each
            # position's entries in index order.
            key = jnp.where(wanted, pos, N)
            order = jnp.argsort(key, stable=True)
            skey = key[order]
            starts = (skey < N) & jnp.concatenate([jnp.ones((1,), bool), skey[1:] != skey[:-1]])
            first = jnp.zeros((M,), bool).at[order].set(starts)
        # One cumsum ranks both the first misses (in entry order) and the free slots (the second part is offset by
        # the first's total): one scan kernel instead of two.
        ranks = jnp.cumsum(jnp.concatenate([first, free_at]).astype(jnp.int32))
        # A round of no positions has no ranks (M = W = 0): static, so indexing an empty array never traces.
        n_first = ranks[M - 1] if M else jnp.int32(0)
        n_free = (ranks[-1] if M + W else jnp.int32(0)) - n_first
        entry_of_rank = jnp.zeros((F,), jnp.int32).at[jnp.where(first, ranks[:M] - 1, F)].set(
            jnp.arange(M, dtype=jnp.int32), mode="drop")
        victim_of_rank = jnp.full((F,), H, jnp.int32).at[
            jnp.where(free_at, ranks[M:] - n_first - 1, F)].set(slot_at, mode="drop")
        n_fill = jnp.minimum(jnp.minimum(n_first, n_free), F)
        do = jnp.arange(F) < n_fill
        victim = jnp.where(do, victim_of_rank, H)
        entry = jnp.where(do, entry_of_rank, 0)
        new_pos = jnp.where(do, pos[entry], N)
        old_pos = jnp.where(do, pos_of_slot[jnp.minimum(victim, H - 1)], -1)
        new_clock = clock
        if F:  # a round with no fills has no victims (static): nothing to index
            last_victim = victim_of_rank[jnp.maximum(n_fill - 1, 0)]
            new_clock = jnp.where(n_fill > 0, im.rem(last_victim + 1, H), clock)
        return victim, entry, new_pos, old_pos, new_clock, n_fill

    active = jnp.broadcast_to(lane_active[None, :], (Lp, B))
    victim, entry, new_pos, old_pos, new_clock, n_fill = jax.vmap(jax.vmap(per_lane))(
        pos, is_miss, valid, active, clock, slot_at, free_at, maps["position_of_slot"][l_b, s_b])
    # The evicted positions must be read before position_of_slot is updated in place, and only a data dependency
    # orders that (an optimization barrier is removed before copy insertion): without one XLA keeps the old map
    # alive with a copy of the whole map every step. ``old_pos >= -1`` always holds (a position, or -1 for an empty
    # slot), which XLA cannot know: the update's slots depend on the read, and it happens in place.
    victim_after_read = jnp.where(old_pos >= -1, victim, H)
    # Every counter in one reduction (each separate one was a ~1-2 us kernel of 8 short rows).
    evicted = jnp.pad(old_pos >= 0, ((0, 0), (0, 0), (0, M - F)))
    indicators = jnp.stack([is_hit & valid, is_miss & valid, ~is_hit & ~is_miss & valid, evicted], axis=2)
    tally = indicators.astype(jnp.int32).sum(-1)  # [Lp, B, 4]: hits, misses, ring reads, evictions
    counts = jnp.concatenate([tally[..., :3], n_fill[..., None], tally[..., 3:]], axis=-1)
    l_f, w_f = (jnp.broadcast_to(x[..., None], victim.shape) for x in (l_b, w_b))
    # Evictions and fills in one scatter: evicted positions were hot and filled ones were not, so the two sets are
    # disjoint and their order does not matter.
    slot_of_position = maps["slot_of_position"].at[
        jnp.concatenate([l_f, l_f], -1), jnp.concatenate([w_f, w_f], -1),
        jnp.concatenate([jnp.where(old_pos >= 0, old_pos, N), new_pos], -1)].set(
        jnp.concatenate([jnp.full_like(victim, -1), victim], -1).astype(maps["slot_of_position"].dtype),
        mode="drop")
    position_of_slot = maps["position_of_slot"].at[l_f, w_f, victim_after_read].set(new_pos, mode="drop")
    new_maps = dict(pin_round=pin_round, position_of_slot=position_of_slot, slot_of_position=slot_of_position,
                    rounds=maps["rounds"].at[l_b, w_b].set(this_round, mode="drop"),
                    clock=maps["clock"].at[l_b, w_b].set(new_clock, mode="drop"),
                    counters=maps["counters"].at[l_b, w_b].add(counts, mode="drop"))
    return new_maps, entry, victim, n_fill
