"""The offload kernels (interpreted on CPU) == their pure-jnp references, bit for bit: the hot gather (ring / hot /
host sources, dequantised and packed outputs), the fill's bookkeeping (pins, victims, slot maps, clock, counters;
rounds that repeat positions) and the fill's row copy (only the first n_fill rows copied, in place). Lanes map to
session slots in any order, and an inactive lane that carries an active lane's slot changes nothing."""

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernels_pallas import kv_formats as kvf

hg = importlib.import_module("kernels_pallas.hot_gather")
fr = importlib.import_module("kernels_pallas.fill_rows")
frd = importlib.import_module("kernels_pallas.fill_round")

# Interpreted on the CPU, compiled on a GPU: the same tests check the real kernels on the H200.
INTERPRET = jax.default_backend() not in ("gpu", "cuda", "rocm")


def _planes(fmt, n, seed):
    rng = np.random.default_rng(seed)
    mag = 2.0 ** rng.integers(-10, 10, size=(n, 1))
    latent = jnp.asarray(rng.normal(size=(n, 512)) * mag, jnp.float32)
    rope = jnp.asarray(rng.normal(size=(n, 64)), jnp.float32)
    return kvf.pack(fmt, latent, rope)


@pytest.mark.parametrize("fmt", list(kvf.KV_FORMATS))
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("block_rows", [4, 16])  # the model's launch shape, and one with several rows per source
def test_hot_gather_matches_reference(fmt, out_dtype, block_rows):
    ring, hot, host = _planes(fmt, 16, 0), _planes(fmt, 32, 1), _planes(fmt, 96, 2)
    rng = np.random.default_rng(3)
    E = 48
    source = rng.integers(0, 3, E).astype(np.int32)
    row = np.where(source == hg.RING, rng.integers(0, 16, E), np.where(source == hg.HOT, rng.integers(0, 32, E),
                                                                       rng.integers(0, 96, E))).astype(np.int32)
    row[:4] = [0, 15, 31, 95] if fmt else row[:4]
    source[:4] = [hg.RING, hg.RING, hg.HOT, hg.HOST]
    row[5:9], source[5:9] = 7, hg.HOST  # duplicate misses
    # Blocks without a miss, one of them ring and hot rows mixed.
    source[16:32] = np.where(np.arange(16) % 3 == 0, hg.RING, hg.HOT)
    row[16:32] = np.where(source[16:32] == hg.RING, np.arange(16), 2 * np.arange(16))
    assert (source[16:32] != hg.HOST).all() and (source == hg.HOST).any()
    args = (jnp.asarray(source), jnp.asarray(row), ring, hot, host)
    got = hg.hot_gather(*args, kv_format=fmt, out_dtype=out_dtype, block_rows=block_rows, interpret=INTERPRET)
    want = hg.hot_gather_reference(*args, kv_format=fmt, out_dtype=out_dtype, block_rows=block_rows)
    # Packed rows are defined at misses only (what the fill installs); the dequantised rows everywhere.
    got, want = got[:2] + (hg.packed_at_misses(got[2], args[0]),), want[:2] + (hg.packed_at_misses(want[2], args[0]),)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    # The rows are the stored ones, from the right source.
    lat, rope = kvf.unpack(fmt, host, out_dtype)
    np.testing.assert_array_equal(np.asarray(got[0][3]), np.asarray(lat[95]))
    np.testing.assert_array_equal(np.asarray(got[1][6]), np.asarray(rope[7]))
    hot_lat, _ = kvf.unpack(fmt, hot, out_dtype)
    np.testing.assert_array_equal(np.asarray(got[0][2]), np.asarray(hot_lat[31]))
    for n in host:
        np.testing.assert_array_equal(np.asarray(got[2][n][3]), np.asarray(host[n][95]))
        np.testing.assert_array_equal(np.asarray(got[2][n][6]), np.asarray(host[n][7]))


def test_hot_gather_validation():
    p = _planes("q8g64", 16, 0)
    s = jnp.zeros((16,), jnp.int32)
    with pytest.raises(ValueError, match="multiple of block_rows"):
        hg.hot_gather_reference(s[:10], s[:10], p, p, p, kv_format="q8g64")
    with pytest.raises(ValueError, match="needs planes"):
        hg.hot_gather_reference(s, s, p, p, p, kv_format="bf16")


def test_hot_gather_planes_checked_against_the_format_and_no_entries():
    """Planes of the wrong width, dtype or rank for the format, and non-integer sources or rows, are named at trace
    time (a narrower latent plane failed as a broadcast inside the kernel, a float row was truncated); E = 0 gives
    empty outputs from the kernel as from the reference (a grid of zero programs failed in the interpreter)."""
    p = _planes("q8g64", 16, 0)
    s = jnp.zeros((16,), jnp.int32)
    for fn in (hg.hot_gather_reference, lambda *a, **k: hg.hot_gather(*a, interpret=INTERPRET, **k)):
        bad = {"narrow": {**p, "latent": p["latent"][:, :256]}, "dtype": {**p, "scale": p["scale"].astype(jnp.float32)},
               "rank": {n: v[None] for n, v in p.items()}}
        for what, planes in bad.items():
            with pytest.raises(ValueError, match="must be flat"):
                fn(s, s, planes, planes, planes, kv_format="q8g64")
        with pytest.raises(ValueError, match="row must be an integer array"):
            fn(s, s.astype(jnp.float32), p, p, p, kv_format="q8g64")
        latent, rope, packed = fn(s[:0], s[:0], p, p, p, kv_format="q8g64", out_dtype=jnp.float32)
        assert latent.shape == (0, 512) and rope.shape == (0, 64) and latent.dtype == jnp.float32
        assert {n: (v.shape, v.dtype) for n, v in packed.items()} == {
            n: ((0, v.shape[1]), v.dtype) for n, v in p.items()}


def _fill_case(seed, layers, lane_slot=(2, 0, 0), S=3, E=24, F=32, H=40, L=4, fmt="q8g64"):
    """Lane b fills slot lane_slot[b]; the last lane is padding (n_fill 0, junk lists) on an active lane's slot.
    ``E``: entries a lane, for every layer or per layer (the MTP layer's round is narrower than the others')."""
    rng = np.random.default_rng(seed)
    B = len(lane_slot)
    Es = (E,) * len(layers) if isinstance(E, int) else tuple(E)
    hot = {n: v.reshape(L * S * H, -1) for n, v in _planes(fmt, L * S * H, seed).items()}
    rows = [{n: v for n, v in _planes(fmt, B * Es[i], seed + 1 + i).items()} for i in range(len(layers))]
    Lp = len(layers)
    entry = np.zeros((Lp, B, F), np.int32)
    victim = np.zeros((Lp, B, F), np.int32)
    n_fill = np.zeros((Lp, B), np.int32)
    for i in range(Lp):
        for b in range(B):
            E = Es[i]
            n = [0, min(E, H, F), int(rng.integers(1, min(E, H, F)))][(i + b) % 3] if b < B - 1 else 0
            n_fill[i, b] = n
            entry[i, b, :n] = rng.choice(E, n, replace=False)
            victim[i, b, :n] = rng.choice(H, n, replace=False)
            entry[i, b, n:] = rng.integers(-5, 1000, F - n)  # junk past n_fill: must be ignored
            victim[i, b, n:] = rng.integers(-5, 1000, F - n)
    return hot, rows, jnp.asarray(entry), jnp.asarray(victim), jnp.asarray(n_fill), jnp.asarray(lane_slot, jnp.int32)


@pytest.mark.parametrize("layers,programs_per_lane,E",
                         [((0, 1, 2), 8, 24), ((1, 3), 1, 24), ((0, 2, 3), 8, (24, 24, 16))])
def test_fill_rows_matches_reference(layers, programs_per_lane, E):
    """programs_per_lane 8 > the 4 blocks of F: one block a program; 1: a program loops over up to 3 blocks.
    Layers may hold rounds of different widths (E per layer), each read at its own lane stride."""
    S, F, H, L = 3, 32, 40, 4
    hot, rows, entry, victim, n_fill, lane_slot = _fill_case(0, layers, S=S, E=E, F=F, H=H, L=L)
    Es = (E,) * len(layers) if isinstance(E, int) else E
    kw = dict(layers=layers, sessions=S, hot_rows=H, block_rows=8, programs_per_lane=programs_per_lane)
    before = {n: np.asarray(v) for n, v in hot.items()}
    fresh = lambda: {n: jnp.array(v) for n, v in before.items()}
    got = fr.fill_rows(fresh(), tuple(rows), entry, victim, n_fill, lane_slot, interpret=INTERPRET, **kw)
    want = fr.fill_rows_reference(fresh(), tuple(rows), entry, victim, n_fill, lane_slot, **kw)
    for n in before:
        np.testing.assert_array_equal(np.asarray(got[n]), np.asarray(want[n]))
    # Independently: exactly the first n_fill rows of each (layer, lane) moved to its slot, nothing else changed.
    expect = {n: v.copy() for n, v in before.items()}
    e, v, nf, ls = np.asarray(entry), np.asarray(victim), np.asarray(n_fill), np.asarray(lane_slot)
    for i, layer in enumerate(layers):
        for b in range(len(ls)):
            for f in range(nf[i, b]):
                for n in expect:
                    expect[n][(layer * S + ls[b]) * H + v[i, b, f]] = np.asarray(rows[i][n])[b * Es[i] + e[i, b, f]]
    for n in expect:
        np.testing.assert_array_equal(np.asarray(got[n]), expect[n])
    assert int(nf[:, :-1].max()) > 0 and int(nf[:, :-1].min()) == 0
    # The padding lane (slot 0, like lane 1) changed nothing: the same as without it.
    B = len(ls) - 1
    alone = fr.fill_rows(fresh(), tuple({n: r[n][:B * Es[i]] for n in r} for i, r in enumerate(rows)), entry[:, :B],
                         victim[:, :B],
                         n_fill[:, :B], lane_slot[:B], interpret=INTERPRET, **kw)
    for n in before:
        np.testing.assert_array_equal(np.asarray(got[n]), np.asarray(alone[n]))


def test_fill_rows_validation():
    hot, rows, entry, victim, n_fill, lane_slot = _fill_case(0, (0, 1))
    kw = dict(layers=(0, 1), sessions=3, hot_rows=40, block_rows=8)
    with pytest.raises(ValueError, match="n_fill"):
        fr.fill_rows_reference(hot, tuple(rows), entry, victim, n_fill[:1], lane_slot, **kw)
    with pytest.raises(ValueError, match="row dicts"):
        fr.fill_rows_reference(hot, tuple(rows[:1]), entry, victim, n_fill, lane_slot, **kw)
    with pytest.raises(ValueError, match="lanes"):
        fr.fill_rows_reference(hot, tuple(rows), entry, victim, n_fill, lane_slot[:2], **kw)
    with pytest.raises(ValueError, match="hot plane"):
        fr.fill_rows_reference(hot, tuple(rows), entry, victim, n_fill, lane_slot, **{**kw, "sessions": 7})


def _round_case(seed, layers, lane_slot=(2, 0), lane_active=None, S=3, L=4, H=48, N=200, M=40, T=1,
                occupancy=1.0):
    """Consistent maps per (layer, slot) (a bijection of occupied slots and hot positions, about ``occupancy`` of
    the slots occupied), pins stamped at or before the current round, and one round per layer and lane, classified
    against the lane's slot as the offload classify would (ring above host_len, hit when hot, miss otherwise), some
    entries invalid. A round is T query rows of M // T positions each (distinct within a row); with T > 1 the rows
    select from a shared pool, so a position repeats up to T times."""
    rng = np.random.default_rng(seed)
    pos_of_slot = np.full((L, S, H), -1, np.int32)
    slot_of_pos = np.full((L, S, N), -1, np.int32)
    for l in range(L):
        for s in range(S):
            n = int(rng.binomial(H, occupancy))
            slots, positions = rng.choice(H, n, replace=False), rng.choice(N, n, replace=False)
            pos_of_slot[l, s, slots], slot_of_pos[l, s, positions] = positions, slots
    rounds_done = rng.integers(0, 50, (L, S)).astype(np.int32)
    maps = dict(pin_round=rng.integers(0, rounds_done[..., None] + 1, (L, S, H)).astype(np.int32),
                position_of_slot=pos_of_slot, slot_of_position=slot_of_pos, rounds=rounds_done,
                clock=rng.integers(0, H, (L, S)).astype(np.int32),
                counters=rng.integers(0, 1000, (L, S, 5)).astype(np.int32))
    assert M % T == 0
    K = M // T
    rounds = []
    for l in layers:
        pos = []
        for s in lane_slot:
            if T == 1:
                pos.append(rng.choice(N, M, replace=False))
            else:
                pool = rng.choice(N, min(N, K + int(rng.integers(0, K + 1))), replace=False)
                pos.append(np.concatenate([rng.choice(pool, K, replace=False) for _ in range(T)]))
        pos = np.stack(pos).astype(np.int32)
        host_len = rng.integers(N // 2, N + 1, (len(lane_slot), 1))
        slot = np.stack([slot_of_pos[l, s, p] for s, p in zip(lane_slot, pos)])
        source = np.where(pos >= host_len, hg.RING, np.where(slot >= 0, hg.HOT, hg.HOST)).astype(np.int32)
        rounds.append(dict(pos=pos, source=source, slot=slot, valid=rng.random(pos.shape) < 0.9))
    if lane_active is None:
        lane_active = [True] * len(lane_slot)
    return maps, rounds, np.asarray(lane_slot, np.int32), np.asarray(lane_active, bool)


def _run_fill_round(fn, maps, rounds, lane_slot, lane_active, **kw):
    """``fn`` on fresh device copies of a numpy case (the maps are donated); numpy outputs."""
    out = fn({n: jnp.asarray(v) for n, v in maps.items()},
             tuple({k: jnp.asarray(v) for k, v in r.items()} for r in rounds),
             jnp.asarray(lane_slot), jnp.asarray(lane_active), **kw)
    return {n: np.asarray(v) for n, v in out[0].items()}, *(np.asarray(x) for x in out[1:])


def _fill_round_kernel_vs_reference(maps, rounds, lane_slot, lane_active, layers, H, distinct=True, max_repeats=1):
    """Run the kernel (interpreted) and the reference on the same numpy case; assert every output equal, bit for
    bit. Returns the kernel's outputs."""
    kw = dict(layers=layers, hot_rows=H, distinct=distinct, max_repeats=max_repeats)
    got = _run_fill_round(frd.fill_round, maps, rounds, lane_slot, lane_active, interpret=INTERPRET, **kw)
    want = _run_fill_round(frd.fill_round_reference, maps, rounds, lane_slot, lane_active, **kw)
    for n in frd.MAP_NAMES:
        np.testing.assert_array_equal(got[0][n], want[0][n], err_msg=n)
    for g, w, name in zip(got[1:], want[1:], ("entry", "victim", "n_fill")):
        np.testing.assert_array_equal(g, w, err_msg=name)
    return got


def _first_misses(r):
    """Entry indices of a lane's round that a fill installs, in order: each missed position's first valid entry."""
    seen, firsts = set(), []
    for m in np.nonzero((r["source"] == hg.HOST) & r["valid"])[0]:
        if r["pos"][m] not in seen:
            seen.add(r["pos"][m])
            firsts.append(int(m))
    return firsts


def _check_fill_round_oracle(maps, rounds, lane_slot, lane_active, layers, H, got):
    """Independently of kernel and reference: what a fill must do."""
    new, entry, victim, n_fill = got
    M = rounds[0]["pos"].shape[1]
    F, W = frd.sizes(M, H)
    touched = set()
    for i, l in enumerate(layers):
        for b, s in enumerate(lane_slot):
            if not lane_active[b]:
                assert n_fill[i, b] == 0 and (entry[i, b] == 0).all() and (victim[i, b] == H).all()
                continue
            touched.add((l, s))
            r = {k: v[b] for k, v in rounds[i].items()}
            hits, misses = r["source"] == hg.HOT, (r["source"] == hg.HOST) & r["valid"]
            hit_slots = set(r["slot"][hits].tolist())
            assert (new["pin_round"][l, s, list(hit_slots)] == maps["rounds"][l, s] + 1).all()
            window = [(maps["clock"][l, s] + w) % H for w in range(W)]
            free = [x for x in window if x not in hit_slots]
            firsts = _first_misses(r)
            n = n_fill[i, b]
            assert n == min(len(firsts), len(free), F)
            assert victim[i, b, :n].tolist() == free[:n]  # the first free slots in clock order
            assert entry[i, b, :n].tolist() == firsts[:n]  # missed positions in first-occurrence entry order
            assert (victim[i, b, n:] == H).all() and (entry[i, b, n:] == 0).all()
            # the maps stay a bijection and hold the new positions; hit slots keep theirs
            occupied = np.nonzero(new["position_of_slot"][l, s] >= 0)[0]
            assert (new["slot_of_position"][l, s, new["position_of_slot"][l, s, occupied]] == occupied).all()
            assert (new["slot_of_position"][l, s] >= 0).sum() == len(occupied)
            assert (new["position_of_slot"][l, s, victim[i, b, :n]] == r["pos"][entry[i, b, :n]]).all()
            assert (new["position_of_slot"][l, s, list(hit_slots)] ==
                    maps["position_of_slot"][l, s, list(hit_slots)]).all()
            evicted = (maps["position_of_slot"][l, s, victim[i, b, :n]] >= 0).sum()
            delta = new["counters"][l, s] - maps["counters"][l, s]
            assert delta.tolist() == [(hits & r["valid"]).sum(), misses.sum(),
                                      ((r["source"] == hg.RING) & r["valid"]).sum(), n, evicted]
            assert new["rounds"][l, s] == maps["rounds"][l, s] + 1
            assert new["clock"][l, s] == ((victim[i, b, n - 1] + 1) % H if n else maps["clock"][l, s])
    L, S = maps["rounds"].shape
    untouched = np.array([[(l, s) not in touched for s in range(S)] for l in range(L)])
    for n in frd.MAP_NAMES:
        np.testing.assert_array_equal(new[n][untouched], maps[n][untouched], err_msg=n)


@pytest.mark.parametrize("layers,H,M", [((0, 1, 2, 3), 48, 40), ((1, 3), 200, 40), ((2,), 32, 30),
                                        ((0, 1), 64, 64)])
def test_fill_round_matches_reference(layers, H, M):
    """Decode rounds (distinct positions); lanes 0, 1 on slots 2, 0."""
    maps, rounds, lane_slot, lane_active = _round_case(0, layers, H=H, M=M)
    got = _fill_round_kernel_vs_reference(maps, rounds, lane_slot, lane_active, layers, H)
    _check_fill_round_oracle(maps, rounds, lane_slot, lane_active, layers, H, got)


@pytest.mark.parametrize("T,H", [(2, 48), (4, 24)])
def test_fill_round_repeated_positions(T, H):
    """Verify rounds: T query rows that overlap, so positions repeat up to T times; max_repeats = T elects each
    position's first entry, as the reference does. H = 24 < M: fewer slots than missed positions."""
    layers, M = (0, 2), 32
    maps, rounds, lane_slot, lane_active = _round_case(1, layers, H=H, M=M, T=T, N=64, occupancy=0.5)
    wanted = [(r["source"][b] == hg.HOST) & r["valid"][b] for r in rounds for b in range(2)]
    counts = [np.bincount(r["pos"][b][w]) for (r, b), w in zip([(r, b) for r in rounds for b in range(2)], wanted)]
    assert max(c.max() for c in counts) == T, "the case must repeat some missed position T times"
    got = _fill_round_kernel_vs_reference(maps, rounds, lane_slot, lane_active, layers, H, distinct=False,
                                          max_repeats=T)
    _check_fill_round_oracle(maps, rounds, lane_slot, lane_active, layers, H, got)
    # Distinct rounds through the non-distinct path: the same as the distinct path.
    maps, rounds, lane_slot, lane_active = _round_case(2, layers, H=H, M=M, N=64)
    a = _fill_round_kernel_vs_reference(maps, rounds, lane_slot, lane_active, layers, H, distinct=False,
                                        max_repeats=T)
    b = _run_fill_round(frd.fill_round, maps, rounds, lane_slot, lane_active, layers=layers, hot_rows=H,
                        interpret=INTERPRET)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)


def test_fill_round_fewer_election_rounds_than_repeats():
    """max_repeats below a position's multiplicity: the elected entry need not be the first, but every missed
    position is still filled once (no slot wasted on a duplicate), and the maps stay consistent."""
    layers, M, H, T = (1,), 32, 64, 4
    maps, rounds, lane_slot, lane_active = _round_case(3, layers, H=H, M=M, T=T, N=64, occupancy=0.3)
    new, entry, victim, n_fill = _run_fill_round(frd.fill_round, maps, rounds, lane_slot, lane_active,
                                                 layers=layers, hot_rows=H, distinct=False, max_repeats=1,
                                                 interpret=INTERPRET)
    for b, s in enumerate(lane_slot):
        r = {k: v[b] for k, v in rounds[0].items()}
        n = n_fill[0, b]
        missed = set(r["pos"][(r["source"] == hg.HOST) & r["valid"]].tolist())
        filled = r["pos"][entry[0, b, :n]]
        assert n == min(len(missed), frd.sizes(M, H)[0]) and len(set(filled.tolist())) == n
        assert set(filled.tolist()) <= missed and (r["source"][entry[0, b, :n]] == hg.HOST).all()
        occupied = np.nonzero(new["position_of_slot"][1, s] >= 0)[0]
        assert (new["slot_of_position"][1, s, new["position_of_slot"][1, s, occupied]] == occupied).all()
        assert (new["slot_of_position"][1, s] >= 0).sum() == len(occupied)


@pytest.mark.parametrize("distinct", [True, False])
def test_fill_round_compacted_path_searches_the_window_in_chunks(distinct):
    """A warm cache's round (at most C misses) takes the kernel's compacted path; here the first Wc window slots
    from the clock are all pinned by this round's hits, so its victims come from the second chunk. Beside it a
    lane with more than C misses takes the full path. Both equal the reference and the oracle."""
    H, N, M, clock = 64, 320, 64, 5
    C, Wc = frd.compact_sizes(M, frd._next_pow2(frd.sizes(M, H)[1]))
    assert (C, Wc) == (16, 32)
    pos_of_slot = np.full((1, 2, H), -1, np.int32)
    slot_of_pos = np.full((1, 2, N), -1, np.int32)
    pos_of_slot[0, :] = 100 + np.arange(H)
    slot_of_pos[0, :, 100:100 + H] = np.arange(H)
    maps = dict(pin_round=np.zeros((1, 2, H), np.int32), position_of_slot=pos_of_slot,
                slot_of_position=slot_of_pos, rounds=np.full((1, 2), 7, np.int32),
                clock=np.full((1, 2), clock, np.int32), counters=np.zeros((1, 2, 5), np.int32))
    hit_slots = (clock + np.arange(48)) % H  # the whole first chunk and half the second, pinned
    misses = np.arange(12) * 7  # cold positions
    tail = misses[:4] if not distinct else 90 + np.arange(4)  # repeats of missed positions, or 4 more misses
    warm = np.concatenate([100 + hit_slots, misses, tail]).astype(np.int32)
    cold = np.arange(M, dtype=np.int32) * 3  # below 100 and beyond 163: every entry a miss
    cold[cold >= 100] += 100
    pos = np.stack([warm, cold])
    slot = np.stack([slot_of_pos[0, 0, warm], slot_of_pos[0, 1, cold]])
    source = np.where(slot >= 0, hg.HOT, hg.HOST).astype(np.int32)
    valid = np.ones_like(pos, bool)
    valid[0, -1] = False
    rounds = [dict(pos=pos, source=source, slot=slot, valid=valid)]
    lane_slot, lane_active = np.array([0, 1], np.int32), np.array([True, True])
    wanted = ((source == hg.HOST) & valid).sum(1)
    assert wanted[0] <= C < wanted[1], "one lane on each path"
    got = _fill_round_kernel_vs_reference(maps, rounds, lane_slot, lane_active, (0,), H, distinct=distinct,
                                          max_repeats=1 if distinct else 2)
    _check_fill_round_oracle(maps, rounds, lane_slot, lane_active, (0,), H, got)
    n_fill, victim = got[3], got[2]
    assert n_fill[0, 0] == (15 if distinct else 12) and (victim[0, 0, :n_fill[0, 0]] >= 0).all()
    assert set(((victim[0, 0, :n_fill[0, 0]] - clock) % H).tolist()) <= set(range(48, 64)), "second chunk"
    assert n_fill[0, 1] == M  # the full path: every entry missed, nothing pinned


@pytest.mark.parametrize("distinct", [True, False])
def test_fill_round_inactive_lane_is_inert(distinct):
    """Lane 2 is padding on slot 0, which active lane 1 uses, with a round of its own that would hit, miss and fill:
    kernel and reference give the same maps as without that lane, and an empty fill list for it."""
    layers, T = (0, 3), 1 if distinct else 2
    maps, rounds, lane_slot, lane_active = _round_case(4, layers, lane_slot=(2, 0, 0),
                                                       lane_active=(True, True, False), T=T)
    kw = dict(layers=layers, hot_rows=48, distinct=distinct, max_repeats=T)
    got = _fill_round_kernel_vs_reference(maps, rounds, lane_slot, lane_active, *kw.values())
    _check_fill_round_oracle(maps, rounds, lane_slot, lane_active, layers, 48, got)
    assert (got[3][:, :2] > 0).all(), "the active lanes fill"
    two = [{k: v[:2] for k, v in r.items()} for r in rounds]
    for fn, extra in ((frd.fill_round, dict(interpret=INTERPRET)), (frd.fill_round_reference, {})):
        alone = _run_fill_round(fn, maps, two, lane_slot[:2], lane_active[:2], **kw, **extra)
        for n in frd.MAP_NAMES:
            np.testing.assert_array_equal(got[0][n], alone[0][n], err_msg=n)
        for g, a in zip(got[1:], alone[1:]):
            np.testing.assert_array_equal(g[:, :2], a)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**31 - 1), st.integers(1, 3), st.integers(1, 70), st.integers(1, 30), st.integers(1, 3),
       st.sampled_from([(0,), (1, 2), (0, 1, 2, 3), (3, 1)]), st.floats(0.0, 1.0), st.data())
def test_fill_round_matches_reference_random_sizes(seed, S, H, K, T, layers, occupancy, data):
    """Any sizes: fewer slots than positions (F = H), windows covering the whole cache, empty and full caches,
    lanes on slots in any order, padding lanes on any slot, positions repeated up to T times."""
    rng = np.random.default_rng(seed)
    n_active = data.draw(st.integers(0, S))
    n_idle = data.draw(st.integers(0 if n_active else 1, 2))
    lane_slot = np.concatenate([rng.permutation(S)[:n_active], rng.integers(0, S, n_idle)])
    lane_active = np.arange(len(lane_slot)) < n_active
    perm = rng.permutation(len(lane_slot))
    lane_slot, lane_active = lane_slot[perm], lane_active[perm]
    M = K * T
    maps, rounds, lane_slot, lane_active = _round_case(seed, layers, lane_slot=tuple(lane_slot),
                                                       lane_active=tuple(lane_active), S=S, H=H,
                                                       N=max(M + 5, 2 * H), M=M, T=T, occupancy=occupancy)
    got = _fill_round_kernel_vs_reference(maps, rounds, lane_slot, lane_active, layers, H, distinct=T == 1,
                                          max_repeats=T)
    _check_fill_round_oracle(maps, rounds, lane_slot, lane_active, layers, H, got)


@pytest.mark.parametrize("T", [1, 4])
def test_fill_round_int16_slot_map(T):
    """The slot map as the cache stores it when hot_rows <= 32,768 (int16, glm53.offload.slot_map_dtype): kernel ==
    reference bit for bit, int16 in and out, -1 where not hot, and the same maps, entries and victims as with an
    int32 map (T = 4: verify rounds whose elections use the map as scratch)."""
    layers, H, M = (0, 2), 48, 32
    maps, rounds, lane_slot, lane_active = _round_case(5, layers, lane_slot=(2, 0, 0),
                                                       lane_active=(True, True, False), H=H, M=M, T=T, N=96,
                                                       occupancy=0.6)
    small = {**maps, "slot_of_position": maps["slot_of_position"].astype(np.int16)}
    got = _fill_round_kernel_vs_reference(small, rounds, lane_slot, lane_active, layers, H, distinct=T == 1,
                                          max_repeats=T)
    assert got[0]["slot_of_position"].dtype == np.int16
    _check_fill_round_oracle(small, rounds, lane_slot, lane_active, layers, H, got)
    wide = _run_fill_round(frd.fill_round, maps, rounds, lane_slot, lane_active, layers=layers, hot_rows=H,
                           distinct=T == 1, max_repeats=T, interpret=INTERPRET)
    for n in frd.MAP_NAMES:
        np.testing.assert_array_equal(got[0][n].astype(np.int32), wide[0][n], err_msg=n)
    for g, w in zip(got[1:], wide[1:]):
        np.testing.assert_array_equal(g, w)


def test_fill_round_validation():
    maps, rounds, lane_slot, lane_active = _round_case(0, (0, 1))
    j = {n: jnp.asarray(v) for n, v in maps.items()}
    ls, la = jnp.asarray(lane_slot), jnp.asarray(lane_active)
    with pytest.raises(ValueError, match="one round per layer"):
        frd.fill_round_reference(j, tuple(rounds[:1]), ls, la, layers=(0, 1), hot_rows=48)
    with pytest.raises(ValueError, match="hot_rows"):
        frd.fill_round_reference(j, tuple(rounds), ls, la, layers=(0, 1), hot_rows=40)
    with pytest.raises(ValueError, match="counters"):
        frd.fill_round_reference({**j, "counters": j["counters"][..., :4]}, tuple(rounds), ls, la, layers=(0, 1),
                                 hot_rows=48)
    with pytest.raises(ValueError, match="lane_active"):
        frd.fill_round_reference(j, tuple(rounds), ls, la.astype(jnp.int32), layers=(0, 1), hot_rows=48)
    with pytest.raises(ValueError, match="one row per lane"):
        frd.fill_round_reference(j, tuple(rounds), ls[:1], la[:1], layers=(0, 1), hot_rows=48)
    with pytest.raises(ValueError, match="max_repeats"):
        frd.fill_round(j, tuple(rounds), ls, la, layers=(0, 1), hot_rows=48, distinct=False, max_repeats=0,
                       interpret=INTERPRET)
    with pytest.raises(ValueError, match="int16 or int32"):
        frd.fill_round_reference({**j, "slot_of_position": j["slot_of_position"].astype(jnp.int8)}, tuple(rounds),
                                 ls, la, layers=(0, 1), hot_rows=48)
    with pytest.raises(ValueError, match="pin_round must be int32"):
        frd.fill_round_reference({**j, "pin_round": j["pin_round"].astype(jnp.int16)}, tuple(rounds), ls, la,
                                 layers=(0, 1), hot_rows=48)
    # an int16 map cannot take the election codes of rounds past 16,384 positions (prefill-sized rounds take the
    # reference: kernels_pallas.ops.MAX_KERNEL_ROUND_POSITIONS)
    M = 16385
    big = tuple(dict(pos=jnp.zeros((2, M), jnp.int32), source=jnp.zeros((2, M), jnp.int32),
                     slot=jnp.full((2, M), -1, jnp.int32), valid=jnp.zeros((2, M), bool)) for _ in range(2))
    with pytest.raises(ValueError, match="election codes"):
        frd.fill_round({**j, "slot_of_position": j["slot_of_position"].astype(jnp.int16)}, big, ls, la,
                       layers=(0, 1), hot_rows=48, distinct=False, max_repeats=2, interpret=INTERPRET)


def test_ops_offload_fill_kernel_equals_reference():
    """The ops the offload step calls, kernels against references in one jit each: the hot gather with host planes
    in pinned_host memory, then fill_round (a verify round, positions repeated) and fill_rows (F padded to the
    kernel's block) on the gathered packed rows."""
    from kernels_pallas import ops

    fmt, layers, S, H, L, M, T = "q8g64", (0, 2), 3, 24, 4, 32, 2
    maps, rounds, lane_slot, lane_active = _round_case(7, layers, lane_slot=(2, 0, 0),
                                                       lane_active=(True, True, False), S=S, L=L, H=H, N=64, M=M,
                                                       T=T, occupancy=0.5)
    host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    ring, history = _planes(fmt, 16, 0), {n: jax.device_put(v, host) for n, v in _planes(fmt, L * S * 64, 1).items()}
    hot = {n: v.reshape(L * S * H, -1) for n, v in _planes(fmt, L * S * H, 2).items()}

    def step(maps, hot, impl):
        packed = []
        for i, l in enumerate(layers):
            r = rounds[i]
            row = np.where(r["source"] == hg.HOT, (l * S + lane_slot[:, None]) * H + np.maximum(r["slot"], 0),
                           np.where(r["source"] == hg.HOST, (l * S + lane_slot[:, None]) * 64 + r["pos"], 0))
            _, _, p = ops.hot_gather(jnp.asarray(r["source"].reshape(-1)), jnp.asarray(row.reshape(-1), jnp.int32),
                                     ring, hot, history, kv_format=fmt, out_dtype=jnp.float32, impl=impl)
            packed.append(p)
        maps, entry, victim, n_fill = ops.fill_round(
            maps, tuple({k: jnp.asarray(v) for k, v in r.items()} for r in rounds), jnp.asarray(lane_slot),
            jnp.asarray(lane_active), layers=layers, hot_rows=H, distinct=False, max_repeats=T, impl=impl)
        hot = ops.fill_rows(hot, tuple(packed), entry, victim, n_fill, jnp.asarray(lane_slot), layers=layers,
                            sessions=S, hot_rows=H, impl=impl)
        return maps, hot, entry, victim, n_fill

    run = jax.jit(step, static_argnames="impl")
    fresh = lambda: ({n: jnp.asarray(v) for n, v in maps.items()}, {n: jnp.array(v) for n, v in hot.items()})
    got = run(*fresh(), impl="pallas")
    want = run(*fresh(), impl="reference")
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert int(np.asarray(got[4]).sum()) > 0


def test_fill_rows_n_fill_past_f_copies_f_rows():
    """A count above the F fills listed copies those F (the reference's rule): the compiled kernel used to read entry
    and victim past F, from the next lane's lists or past the arrays, and store there (the interpreter clamps such
    reads, so on the CPU this passed before too; it checks the GPU kernel where these tests run compiled)."""
    hot, rows, entry, victim, n_fill, lane_slot = _fill_case(0, (0, 1))
    kw = dict(layers=(0, 1), sessions=3, hot_rows=40, block_rows=8)
    F = entry.shape[2]
    before = {n: np.asarray(v) for n, v in hot.items()}
    fresh = lambda: {n: jnp.array(v) for n, v in before.items()}
    rng = np.random.default_rng(1)
    for i, b in ((0, 0), (1, 1)):  # every listed fill valid: entries below E = 24, distinct victims below H = 40
        entry = entry.at[i, b].set(rng.integers(0, 24, F))
        victim = victim.at[i, b].set(rng.choice(40, F, replace=False))
    over = n_fill.at[0, 0].set(F + 8).at[1, 1].set(3 * F)
    got = fr.fill_rows(fresh(), tuple(rows), entry, victim, over, lane_slot, interpret=INTERPRET, **kw)
    at_f = fr.fill_rows(fresh(), tuple(rows), entry, victim, jnp.minimum(over, F), lane_slot, interpret=INTERPRET,
                        **kw)
    want = fr.fill_rows_reference(fresh(), tuple(rows), entry, victim, over, lane_slot, **kw)
    for n in before:
        np.testing.assert_array_equal(np.asarray(got[n]), np.asarray(want[n]), err_msg=n)
        np.testing.assert_array_equal(np.asarray(got[n]), np.asarray(at_f[n]), err_msg=n)


def test_fill_rows_no_fills_and_integer_lists():
    """F = 0 (a round of no positions) and B = 0 lanes copy nothing, kernel and reference alike (a zero-size grid
    failed deep in the interpreter, the reference divided by B = 0); float lists are refused, not truncated."""
    hot, rows, entry, victim, n_fill, lane_slot = _fill_case(0, (0, 1))
    kw = dict(layers=(0, 1), sessions=3, hot_rows=40, block_rows=8)
    before = {n: np.asarray(v) for n, v in hot.items()}
    no_lanes = tuple({n: v[:0] for n, v in r.items()} for r in rows)
    for fn in (functools.partial(fr.fill_rows, interpret=INTERPRET), fr.fill_rows_reference):
        for args in ((tuple(rows), entry[..., :0], victim[..., :0], n_fill, lane_slot),
                     (no_lanes, entry[:, :0], victim[:, :0], n_fill[:, :0], lane_slot[:0])):
            out = fn({n: jnp.array(v) for n, v in before.items()}, *args, **kw)
            for n in before:
                np.testing.assert_array_equal(np.asarray(out[n]), before[n])
        with pytest.raises(ValueError, match="entry must be an integer array"):
            fn({n: jnp.array(v) for n, v in before.items()}, tuple(rows), entry.astype(jnp.float32), victim, n_fill,
               lane_slot, **kw)


def test_fill_round_of_no_positions_or_no_lanes():
    """A round of M = 0 positions (kernel == reference: the reference indexed its empty ranks) advances the active
    lanes' rounds and changes nothing else; B = 0 lanes change nothing (the kernel's grid of zero programs failed in
    the interpreter). Float positions are refused rather than truncated."""
    layers, H = (0, 2), 48
    maps, rounds, lane_slot, lane_active = _round_case(0, layers, H=H, M=8, lane_active=[True, False])
    empty = [{k: v[:, :0] for k, v in r.items()} for r in rounds]
    new, entry, victim, n_fill = _fill_round_kernel_vs_reference(maps, empty, lane_slot, lane_active, layers, H)
    assert entry.shape == victim.shape == (2, 2, 0) and not n_fill.any()
    want = {n: v.copy() for n, v in maps.items()}
    want["rounds"][list(layers), lane_slot[0]] += 1
    for n in frd.MAP_NAMES:
        np.testing.assert_array_equal(new[n], want[n], err_msg=n)
    no_lanes = [{k: v[:0] for k, v in r.items()} for r in rounds]
    new, entry, victim, n_fill = _fill_round_kernel_vs_reference(maps, no_lanes, lane_slot[:0], lane_active[:0],
                                                                 layers, H)
    assert entry.shape == victim.shape == (2, 0, 8) and n_fill.shape == (2, 0)
    for n in frd.MAP_NAMES:
        np.testing.assert_array_equal(new[n], maps[n], err_msg=n)
    floats = [{**r, "pos": r["pos"].astype(np.float32)} for r in rounds]
    with pytest.raises(ValueError, match="pos must be an integer array"):
        _run_fill_round(frd.fill_round_reference, maps, floats, lane_slot, lane_active, layers=layers, hot_rows=H)
