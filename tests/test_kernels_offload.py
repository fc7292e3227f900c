"""The offload kernels (interpreted on CPU) == their pure-jnp references, bit for bit: the hot gather (ring / hot /
host sources, dequantised and packed outputs), the fill's bookkeeping (pins, victims, slot maps, clock, counters)
and the fill's row copy (only the first n_fill rows copied, in place)."""

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
    args = (jnp.asarray(source), jnp.asarray(row), ring, hot, host)
    got = hg.hot_gather(*args, kv_format=fmt, out_dtype=out_dtype, block_rows=block_rows, interpret=True)
    want = hg.hot_gather_reference(*args, kv_format=fmt, out_dtype=out_dtype, block_rows=block_rows)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    # The rows are the stored ones, from the right source.
    lat, rope = kvf.unpack(fmt, host, out_dtype)
    np.testing.assert_array_equal(np.asarray(got[0][3]), np.asarray(lat[95]))
    np.testing.assert_array_equal(np.asarray(got[1][6]), np.asarray(rope[7]))
    for n in host:
        np.testing.assert_array_equal(np.asarray(got[2][n][2]), np.asarray(hot[n][31]))


def test_hot_gather_validation():
    p = _planes("q8g64", 16, 0)
    s = jnp.zeros((16,), jnp.int32)
    with pytest.raises(ValueError, match="multiple of block_rows"):
        hg.hot_gather_reference(s[:10], s[:10], p, p, p, kv_format="q8g64")
    with pytest.raises(ValueError, match="needs planes"):
        hg.hot_gather_reference(s, s, p, p, p, kv_format="bf16")


def _fill_case(seed, layers, B=2, E=24, F=32, H=40, L=4, fmt="q8g64"):
    rng = np.random.default_rng(seed)
    hot = {n: v.reshape(L * B * H, -1) for n, v in _planes(fmt, L * B * H, seed).items()}
    rows = [{n: v for n, v in _planes(fmt, B * E, seed + 1 + i).items()} for i in range(len(layers))]
    Lp = len(layers)
    entry = np.zeros((Lp, B, F), np.int32)
    victim = np.zeros((Lp, B, F), np.int32)
    n_fill = np.zeros((Lp, B), np.int32)
    for i in range(Lp):
        for b in range(B):
            n = [0, min(E, H, F), int(rng.integers(1, min(E, H, F)))][(i + b) % 3]
            n_fill[i, b] = n
            entry[i, b, :n] = rng.choice(E, n, replace=False)
            victim[i, b, :n] = rng.choice(H, n, replace=False)
            entry[i, b, n:] = rng.integers(-5, 1000, F - n)  # junk past n_fill: must be ignored
            victim[i, b, n:] = rng.integers(-5, 1000, F - n)
    return hot, rows, jnp.asarray(entry), jnp.asarray(victim), jnp.asarray(n_fill)


@pytest.mark.parametrize("layers", [(0, 1, 2), (3,), (1, 3)])
def test_fill_rows_matches_reference(layers):
    B, E, F, H, L = 2, 24, 32, 40, 4
    hot, rows, entry, victim, n_fill = _fill_case(0, layers, B, E, F, H, L)
    kw = dict(layers=layers, sessions=B, hot_rows=H, block_rows=8)
    before = {n: np.asarray(v) for n, v in hot.items()}
    got = fr.fill_rows({n: jnp.array(v) for n, v in before.items()}, tuple(rows), entry, victim, n_fill,
                       interpret=True, **kw)
    want = fr.fill_rows_reference({n: jnp.array(v) for n, v in before.items()}, tuple(rows), entry, victim,
                                  n_fill, **kw)
    for n in before:
        np.testing.assert_array_equal(np.asarray(got[n]), np.asarray(want[n]))
    # Independently: exactly the first n_fill rows of each (layer, session) moved, nothing else changed.
    expect = {n: v.copy() for n, v in before.items()}
    e, v, nf = np.asarray(entry), np.asarray(victim), np.asarray(n_fill)
    for i, layer in enumerate(layers):
        for b in range(B):
            for f in range(nf[i, b]):
                for n in expect:
                    expect[n][(layer * B + b) * H + v[i, b, f]] = np.asarray(rows[i][n])[b * E + e[i, b, f]]
    for n in expect:
        np.testing.assert_array_equal(np.asarray(got[n]), expect[n])
    assert int(nf.max()) > 0 and int(nf.min()) == 0


def test_fill_rows_validation():
    hot, rows, entry, victim, n_fill = _fill_case(0, (0, 1))
    with pytest.raises(ValueError, match="n_fill"):
        fr.fill_rows_reference(hot, tuple(rows), entry, victim, n_fill[:1], layers=(0, 1), sessions=2, hot_rows=40,
                               block_rows=8)
    with pytest.raises(ValueError, match="row dicts"):
        fr.fill_rows_reference(hot, tuple(rows[:1]), entry, victim, n_fill, layers=(0, 1), sessions=2,
                               hot_rows=40, block_rows=8)


def _round_case(seed, layers, B=2, L=4, H=48, N=200, M=40):
    """Consistent maps (a bijection of occupied slots and hot positions per layer and session), pins stamped at
    or before the current round, and one decode round per layer: distinct positions classified as the offload
    classify would (ring above host_len, hit when hot, miss otherwise), some entries invalid."""
    rng = np.random.default_rng(seed)
    pos_of_slot = np.full((L, B, H), -1, np.int32)
    slot_of_pos = np.full((L, B, N), -1, np.int32)
    for l in range(L):
        for b in range(B):
            n = int(rng.integers(0, H + 1))
            slots, positions = rng.choice(H, n, replace=False), rng.choice(N, n, replace=False)
            pos_of_slot[l, b, slots], slot_of_pos[l, b, positions] = positions, slots
    rounds_done = rng.integers(0, 50, (L, B)).astype(np.int32)
    maps = dict(pin_round=rng.integers(0, rounds_done[..., None] + 1, (L, B, H)).astype(np.int32),
                position_of_slot=pos_of_slot, slot_of_position=slot_of_pos, rounds=rounds_done,
                clock=rng.integers(0, H, (L, B)).astype(np.int32),
                counters=rng.integers(0, 1000, (L, B, 5)).astype(np.int32))
    rounds = []
    for l in layers:
        pos = np.stack([rng.choice(N, M, replace=False) for _ in range(B)]).astype(np.int32)
        host_len = rng.integers(N // 2, N + 1, B)
        slot = np.take_along_axis(slot_of_pos[l], pos, axis=1)
        source = np.where(pos >= host_len[:, None], hg.RING, np.where(slot >= 0, hg.HOT, hg.HOST)).astype(np.int32)
        rounds.append(dict(pos=pos, source=source, slot=slot, valid=rng.random((B, M)) < 0.9))
    return maps, rounds


def _fill_round_kernel_vs_reference(maps, rounds, layers, H):
    """Run the kernel (interpreted) and the reference on the same numpy case; assert every output equal, bit for
    bit. Returns the kernel's outputs."""
    kw = dict(layers=layers, hot_rows=H)
    j = lambda: ({n: jnp.asarray(v) for n, v in maps.items()},
                 tuple({k: jnp.asarray(v) for k, v in r.items()} for r in rounds))
    got = frd.fill_round(*j(), interpret=True, **kw)
    want = frd.fill_round_reference(*j(), **kw)
    for n in frd.MAP_NAMES:
        np.testing.assert_array_equal(np.asarray(got[0][n]), np.asarray(want[0][n]), err_msg=n)
    for g, w, name in zip(got[1:], want[1:], ("entry", "victim", "n_fill")):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)
    return got


@pytest.mark.parametrize("layers,H,M", [((0, 1, 2, 3), 48, 40), ((1, 3), 200, 40), ((2,), 32, 30),
                                        ((0, 1), 64, 64)])
@pytest.mark.parametrize("seed", [0, 1])
def test_fill_round_matches_reference(layers, H, M, seed):
    maps, rounds = _round_case(seed, layers, H=H, M=M)
    got = _fill_round_kernel_vs_reference(maps, rounds, layers, H)

    # Independently of both: what a fill must do.
    new, entry, victim, n_fill = (np.asarray(x) if not isinstance(x, dict) else {k: np.asarray(v) for k, v in
                                                                                 x.items()} for x in got)
    F, W = frd.sizes(M, H)
    for i, l in enumerate(layers):
        for b in range(2):
            r = {k: v[b] for k, v in rounds[i].items()}
            hits, misses = r["source"] == hg.HOT, (r["source"] == hg.HOST) & r["valid"]
            hit_slots = set(r["slot"][hits].tolist())
            assert (new["pin_round"][l, b, list(hit_slots)] == maps["rounds"][l, b] + 1).all()
            window = [(maps["clock"][l, b] + w) % H for w in range(W)]
            free = [s for s in window if s not in hit_slots]
            n = n_fill[i, b]
            assert n == min(misses.sum(), len(free), F)
            assert victim[i, b, :n].tolist() == free[:n]  # the first free slots in clock order
            assert entry[i, b, :n].tolist() == np.nonzero(misses)[0][:n].tolist()  # misses in selection order
            assert (victim[i, b, n:] == H).all() and (entry[i, b, n:] == 0).all()
            # the maps stay a bijection and hold the new positions; hit slots keep theirs
            occupied = np.nonzero(new["position_of_slot"][l, b] >= 0)[0]
            assert (new["slot_of_position"][l, b, new["position_of_slot"][l, b, occupied]] == occupied).all()
            assert (new["slot_of_position"][l, b] >= 0).sum() == len(occupied)
            assert (new["position_of_slot"][l, b, victim[i, b, :n]] == r["pos"][entry[i, b, :n]]).all()
            assert (new["position_of_slot"][l, b, list(hit_slots)] ==
                    maps["position_of_slot"][l, b, list(hit_slots)]).all()
            evicted = (maps["position_of_slot"][l, b, victim[i, b, :n]] >= 0).sum()
            delta = new["counters"][l, b] - maps["counters"][l, b]
            assert delta.tolist() == [(hits & r["valid"]).sum(), misses.sum(),
                                      ((r["source"] == hg.RING) & r["valid"]).sum(), n, evicted]
            assert new["rounds"][l, b] == maps["rounds"][l, b] + 1
            assert new["clock"][l, b] == ((victim[i, b, n - 1] + 1) % H if n else maps["clock"][l, b])
    untouched = [l for l in range(4) if l not in layers]
    for n in frd.MAP_NAMES:
        np.testing.assert_array_equal(new[n][untouched], maps[n][untouched])


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**31 - 1), st.integers(1, 3), st.integers(1, 70), st.integers(1, 60),
       st.sampled_from([(0,), (1, 2), (0, 1, 2, 3), (3, 1)]), st.floats(0.0, 1.0))
def test_fill_round_matches_reference_random_sizes(seed, B, H, M, layers, occupancy):
    """Any sizes: fewer slots than positions (F = H), windows covering the whole cache, empty and full caches,
    several sessions, non-consecutive layers."""
    N = max(M + 5, 2 * H)
    maps, rounds = _round_case(seed, layers, B=B, H=H, N=N, M=M)
    rng = np.random.default_rng(seed + 1)
    maps["position_of_slot"][rng.random(maps["position_of_slot"].shape) > occupancy] = -1  # free some slots
    sop = np.full_like(maps["slot_of_position"], -1)
    for l, b, s in zip(*np.nonzero(maps["position_of_slot"] >= 0)):
        sop[l, b, maps["position_of_slot"][l, b, s]] = s
    maps["slot_of_position"] = sop
    for i, l in enumerate(layers):  # reclassify against the thinned maps
        r = rounds[i]
        r["slot"] = np.take_along_axis(sop[l], r["pos"], axis=1)
        r["source"] = np.where(r["source"] == hg.RING, hg.RING, np.where(r["slot"] >= 0, hg.HOT, hg.HOST))
    _fill_round_kernel_vs_reference(maps, rounds, layers, H)


def test_fill_round_validation():
    maps, rounds = _round_case(0, (0, 1))
    j = {n: jnp.asarray(v) for n, v in maps.items()}
    with pytest.raises(ValueError, match="one round per layer"):
        frd.fill_round_reference(j, tuple(rounds[:1]), layers=(0, 1), hot_rows=48)
    with pytest.raises(ValueError, match="hot_rows"):
        frd.fill_round_reference(j, tuple(rounds), layers=(0, 1), hot_rows=40)
    with pytest.raises(ValueError, match="distinct"):
        frd.fill_round(j, tuple(rounds), layers=(0, 1), hot_rows=48, distinct=False, interpret=True)
    with pytest.raises(ValueError, match="counters"):
        frd.fill_round_reference({**j, "counters": j["counters"][..., :4]}, tuple(rounds), layers=(0, 1),
                                 hot_rows=48)
