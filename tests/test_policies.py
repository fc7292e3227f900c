"""Selection traces and the policy simulator: a trace recorded from the engine replays through the engine's own
policy to the engine's counters exactly (decode, MTP verify and drafts, several sessions, rollback and fork
between calls); round by round it equals the engine's fill (``fill_round_reference``) from random states; the file
round-trips; every policy keeps its invariants; the policies behave as their definitions say on synthetic traces;
recording changes no output."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import glm53
from glm53 import policies
from glm53.config import ConfigError
from glm53.trace import SelectionTrace, TraceRecorder
from engine_common import CC, engine, ids, make_model

# A small hot cache (64 slots; the least is the ring's 32 + 8 selected) against histories of a few hundred rows:
# evictions.
HOT = 64


@pytest.fixture(scope="module")
def model():
    return make_model()


@pytest.fixture(scope="module")
def recorded(model):
    """The circular offload run of ``_record`` (the tests below only read it): recorded once per module."""
    return _record(model)


def _record(model, tmp_path=None, mode="offload", policy="circular"):
    e = glm53.Engine(model, CC.replace(mode=mode, hot_rows=HOT, policy=policy), max_sessions=3)
    rec = TraceRecorder() if mode == "offload" else None
    a, b = e.open(ids(300, seed=1)), e.open(ids(220, seed=2))
    out = []
    for reqs, mtp in (({a: 24, b: 24}, 0), (None, 2)):
        if reqs is None:
            e.rollback(a, 6)
            c = e.fork(b)
            reqs = {a: 12, c: 12}
        toks = e.generate(reqs, mtp=mtp, trace=rec, return_logits=True)
        out.append([(toks[sid], e.last_run.logits[sid]) for sid in reqs])
    return e, rec, out


def test_engine_trace_replays_to_the_engines_counters(recorded, tmp_path):
    e, rec, _ = recorded
    trace = rec.trace()
    assert len(trace.segments) == 2 and trace.num_records > 0
    want = policies.segment_counts(trace)
    assert want[:, 4].sum() > 0 and want[:, 1].sum() > 0 and want[:, 2].sum() > 0  # evictions, misses, ring reads
    got = policies.replay(trace, "circular", from_snapshots=True)
    assert np.array_equal(np.stack([got.per_layer[n] for n in policies.COUNTS[:5]], 1), want)
    # the file keeps everything the replay needs
    path = trace.save(str(tmp_path / "t.npz"))
    again = policies.replay(SelectionTrace.load(path), "circular", from_snapshots=True)
    assert again.per_layer == got.per_layer and again.scan == got.scan
    # the first segment starts from empty hot caches (fresh sessions): a cold replay of it alone agrees too
    first = SelectionTrace.load(path)
    end = first.segments[0]["end_step"]
    keep = first.step < end
    cut = SelectionTrace(meta=first.meta, sessions=first.sessions, segments=first.segments[:1],
                         **{f: getattr(first, f)[keep] for f in ("step", "layer", "session", "start", "offset",
                                                                  "count")},
                         positions=first.positions, valid=first.valid, in_ring=first.in_ring)
    cold = policies.replay(cut, "circular")
    assert np.array_equal(np.stack([cold.per_layer[n] for n in policies.COUNTS[:5]], 1),
                          policies.segment_counts(cut))


def _same(x, y):
    for part_x, part_y in zip(x, y, strict=True):
        for (tx, lx), (ty, ly) in zip(part_x, part_y, strict=True):
            assert tx == ty and np.array_equal(lx, ly)


def test_recording_changes_no_output(model, recorded):
    _, _, traced = recorded
    e = glm53.Engine(model, CC.replace(mode="offload", hot_rows=HOT), max_sessions=3)
    a, b = e.open(ids(300, seed=1)), e.open(ids(220, seed=2))
    plain = e.generate({a: 24, b: 24}, return_logits=True)
    _same(traced[:1], [[(plain[a], e.last_run.logits[a]), (plain[b], e.last_run.logits[b])]])


def test_engine_lfu_policy(model, recorded):
    """CacheConfig(policy="lfu"): decode, MTP verify and drafts, rollback and fork stay bit-identical to resident;
    the policy is in effect (other fills than circular's on the same run); the offline "lfu" replayed from the
    engine's snapshots reproduces its counters exactly."""
    e, rec, out = _record(model, policy="lfu")
    _, _, resident = _record(model, mode="resident")
    _same(out, resident)
    trace = rec.trace()
    assert trace.meta["policy"] == "lfu" and "policy_hits" in trace.segments[0]["snapshot"]
    want = policies.segment_counts(trace)
    got = policies.replay(trace, "lfu", from_snapshots=True)
    assert np.array_equal(np.stack([got.per_layer[n] for n in policies.COUNTS[:5]], 1), want)
    assert want[:, 4].sum() > 0
    _, circ, _ = recorded
    assert not np.array_equal(policies.segment_counts(circ.trace()), want)
    with pytest.raises(ValueError, match="recording engine's policy"):
        policies.replay(trace, "circular", from_snapshots=True)
    # the accounting counts the policy's state
    parts = glm53.memory.cache_bytes(model.config, e.cache_config, e.alloc_slots, e.capacity, e.alloc_pages,
                                     jnp.float32)
    assert parts["device"]["policy_state.hits"] == np.asarray(e.cache.policy_state["hits"]).nbytes
    with pytest.raises(ConfigError, match="policy"):
        glm53.CacheConfig(policy="fifo")


def test_counters_fold_into_host_totals(model, recorded, monkeypatch):
    """The device's int32 counters are folded into int64 host totals after every generate and every few steps
    inside one (here every 2): stats, and a trace's segment counts, are those of a run that never folds; the
    device counters of the sessions are zero after a generate."""
    e0, rec0, out0 = recorded
    monkeypatch.setattr(glm53.Engine, "fold_every", lambda self, mtp: 2)
    e1, rec1, out1 = _record(model)
    _same(out0, out1)
    for sid in e0.sessions:
        s0, s1 = e0.stats(sid), e1.stats(sid)
        assert s0["per_layer"] == s1["per_layer"] and s0["hits"] == s1["hits"] > 0
    assert np.array_equal(policies.segment_counts(rec0.trace()), policies.segment_counts(rec1.trace()))
    slots = [e1._session(sid).slot for sid in e1.sessions]
    assert not np.asarray(e1.cache.counters)[:, slots].any()
    assert all(e1._session(sid).counter_totals.sum() > 0 for sid in e1.sessions)


def test_trace_needs_an_offload_engine(model):
    e = engine(model, "resident")
    s = e.open(ids(20))
    with pytest.raises(ConfigError, match="offload"):
        e.generate({s: 2}, trace=TraceRecorder())


def test_bad_trace_files_are_refused(tmp_path):
    p = tmp_path / "x.npz"
    np.savez(p, a=np.zeros(3))
    with pytest.raises(ValueError, match="not a selection trace"):
        SelectionTrace.load(str(p))
    (tmp_path / "y.npz").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="not a selection trace"):
        SelectionTrace.load(str(tmp_path / "y.npz"))
    with pytest.raises(ValueError, match="unknown policy"):
        policies.make("fifo", 8, 100)


def _synthetic(rows_per_step, capacity=4096, layers=1):
    return SelectionTrace.from_rounds(
        ((t, l, 0, capacity, r) for t, r in enumerate(rows_per_step) for l in range(layers)),
        meta={"capacity": capacity, "source": "test"})


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(["circular", "clock", "lru", "lfu", "window64+sticky", "lru+prefetch8"]),
       st.integers(8, 64), st.integers(0, 2**31 - 1))
def test_policies_keep_their_invariants(spec, hot, seed):
    """Random rounds with repeats: every count adds up, the maps stay a bijection, nothing exceeds the cache, and a
    position is hot right after the round that missed it (when it fit)."""
    rng = np.random.default_rng(seed)
    N, K = 300, 16
    pol = policies.make(spec, hot, N)
    stt = pol.new_state()
    counts = np.zeros(len(policies.COUNTS), np.int64)
    looked = 0
    for t in range(30):
        pos = rng.integers(0, N, K)
        valid = rng.random(K) < 0.9
        ring = np.zeros(K, bool)
        pol.round(stt, pos, valid, ring, N, t, counts, [])
        looked += valid.sum()
        held = np.flatnonzero(stt.position_of_slot >= 0)
        assert (stt.slot_of_position[stt.position_of_slot[held]] == held).all()
        assert (stt.slot_of_position >= 0).sum() == held.size <= hot
        if np.unique(pos).size <= hot:  # room for every miss beside every pinned hit
            assert (stt.slot_of_position[pos[valid]] >= 0).all()
    assert counts[0] + counts[1] == looked
    assert counts[3] + counts[5] - counts[4] == (stt.position_of_slot >= 0).sum()


def test_policies_on_synthetic_traces():
    """What the definitions imply: a working set that fits always hits once warm, whatever the policy; a scan of
    distinct rows never hits; on a cyclic scan one row larger than the cache LRU and circular miss everything
    while LFU keeps most; clock's victim search walks the cache when everything is referenced."""
    warm = _synthetic([np.arange(32)] * 10)
    for spec in ("circular", "clock", "lru", "lfu", "window8+sticky"):
        r = policies.replay(warm, spec, 64)
        assert r.total("misses") == 32 and r.total("hits") == 32 * 9, spec
    scan = _synthetic([np.arange(t * 16, t * 16 + 16) for t in range(20)])
    for spec in ("circular", "clock", "lru", "lfu"):
        assert policies.replay(scan, spec, 64).total("hits") == 0
    cyc = _synthetic([np.arange(t % 9 * 8, t % 9 * 8 + 8) for t in range(90)])  # 72 rows cycling through 64 slots
    assert policies.replay(cyc, "lru", 64).hit_rate == 0 and policies.replay(cyc, "circular", 64).hit_rate == 0
    # 8 rows read twice every 10 rounds, fresh rows in between (72 of them, more than the 56 slots left): recency
    # forgets the returning rows, frequency keeps them
    back = _synthetic([np.arange(8) if t % 10 < 2 else 1000 + np.arange(t * 8, t * 8 + 8) for t in range(100)])
    lru, circ, lfu = (policies.replay(back, s, 64) for s in ("lru", "circular", "lfu"))
    assert lru.total("hits") == circ.total("hits") == 8 * 10 and lfu.total("hits") == 8 * 19
    # clock: every slot referenced, then a round of misses has to pass all of them
    ref = _synthetic([np.arange(64), np.arange(64), np.arange(64, 72)])
    r = policies.replay(ref, "clock", 64)
    assert r.scan["max"] > 64
    # prefetch of the misses' neighbours turns a sliding window's misses into hits
    slide = _synthetic([np.arange(t * 4, t * 4 + 16) for t in range(40)])
    base, pre = policies.replay(slide, "lru", 64), policies.replay(slide, "lru+prefetch8", 64)
    assert pre.hit_rate > base.hit_rate and pre.total("prefetched") > 0


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**31 - 1), st.integers(1, 3))
def test_circular_round_equals_the_engines_fill(seed, rounds):
    """One (layer, session) at a time, the simulator's circular policy against the engine's own fill
    (``fill_round_reference``) from the same random state: repeated positions, invalid entries (whose hits still
    pin), ring entries, a clock anywhere; the maps, clock and counters agree after every round."""
    import jax.numpy as jnp
    from kernels_pallas.fill_round import fill_round_reference
    from kernels_pallas.hot_gather import HOST, HOT, RING

    rng = np.random.default_rng(seed)
    H, N, M = 16, 64, 24
    pos_of_slot = np.full(H, -1, np.int64)
    held = rng.permutation(N)[: rng.integers(0, H + 1)]
    pos_of_slot[rng.permutation(H)[: held.size]] = held
    pol = policies.make("circular", H, N)
    stt = pol.new_state()
    stt.load(pos_of_slot, int(rng.integers(0, H)))
    sop = np.full(N, -1, np.int32)
    sop[pos_of_slot[pos_of_slot >= 0]] = np.flatnonzero(pos_of_slot >= 0)
    maps = {"pin_round": jnp.asarray(rng.integers(0, 3, (1, 1, H)), jnp.int32),
            "position_of_slot": jnp.asarray(pos_of_slot[None, None], jnp.int32),
            "slot_of_position": jnp.asarray(sop[None, None], jnp.int32),
            "rounds": jnp.full((1, 1), 3, jnp.int32), "clock": jnp.full((1, 1), stt.clock, jnp.int32),
            "counters": jnp.zeros((1, 1, 5), jnp.int32)}
    counts = np.zeros(len(policies.COUNTS), np.int64)
    for t in range(rounds):
        pos = rng.integers(0, N, M)
        valid = rng.random(M) < 0.8
        in_ring = rng.random(M) < 0.1
        sop_now = np.asarray(maps["slot_of_position"])[0, 0]
        slot = sop_now[pos]
        source = np.where(in_ring, RING, np.where(slot >= 0, HOT, HOST))
        r = {"pos": jnp.asarray(pos[None], jnp.int32), "source": jnp.asarray(source[None], jnp.int32),
             "slot": jnp.asarray(slot[None], jnp.int32), "valid": jnp.asarray(valid[None])}
        maps, *_ = fill_round_reference(maps, (r,), jnp.zeros((1,), jnp.int32), jnp.ones((1,), bool), layers=(0,),
                                        hot_rows=H, distinct=False, max_repeats=M)
        pol.round(stt, pos, valid, in_ring, N, t, counts, [])
        assert np.array_equal(np.asarray(maps["position_of_slot"])[0, 0], stt.position_of_slot)
        assert np.array_equal(np.asarray(maps["slot_of_position"])[0, 0], stt.slot_of_position)
        assert int(maps["clock"][0, 0]) == stt.clock
        assert np.asarray(maps["counters"])[0, 0].tolist() == counts[:5].tolist()
