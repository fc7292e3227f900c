"""Selection traces and the policy simulator: a trace recorded from the engine replays through the engine's own
policy to the engine's counters exactly, from the snapshots and cold (decode, MTP verify and drafts, several
sessions, rollback and fork between calls); round by round it equals the engine's fill (``fill_round_reference``)
from random states, circular's and LFU's; clock equals textbook second chance; the file round-trips; every policy
keeps its invariants; the policies behave as their definitions say on synthetic traces; added policies plug in and
are held to the hooks' contract; recording changes no output."""

import json
import re

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


def _table(r):
    return np.stack([r.per_layer[n] for n in policies.COUNTS[:5]], 1)


def test_cold_replay_follows_rollback_and_fork_between_calls(recorded):
    """Between the two calls session a was rolled back and b forked (into c): a cold replay of the engine's own
    policy applies both to its states and so reproduces the engine's counters over the whole run, as the snapshot
    replay does. The trace names the fork's parent and each session's host rows; a trace saved before those were
    kept infers the rollback and starts the child from its snapshot: for the engine's policy, exact as well."""
    _, rec, _ = recorded
    trace = rec.trace()
    want = policies.segment_counts(trace)
    assert np.array_equal(_table(policies.replay(trace, "circular")), want)
    second = trace.segments[1]
    a, b = 0, 1  # session indices, in the order the recorder met them: a, b, then the fork
    assert second["parents"].tolist() == [-1, b] and trace.segments[0]["parents"].tolist() == [-1, -1]
    # a: 324 rows, rolled back to 317 processed: host memory cut to its whole 16-row pages, into what it held
    assert second["sessions"][0] == a and second["host_len"][0] == 304
    old = SelectionTrace(**{**trace.__dict__, "segments": [
        {k: v for k, v in seg.items() if k not in ("host_len", "parents")} for seg in trace.segments]})
    assert np.array_equal(_table(policies.replay(old, "circular")), want)


def _with_segments(rows, segments, capacity=100, hot_rows=4):
    """A one-layer trace of ``rows`` (step, session, positions) with hand-made segments: ``(first, end, sessions,
    host_len, parents, snapshot positions [n, H])``."""
    t = SelectionTrace.from_rounds(((s, 0, sess, 50, p) for s, sess, p in rows),
                                   meta={"capacity": capacity, "hot_rows": hot_rows, "page_rows": 8})
    t.segments = [{"first_step": f, "end_step": e, "sessions": sess, "host_len": np.asarray(hl),
                   "parents": np.asarray(par),
                   "snapshot": {"position_of_slot": np.asarray(snap)[:, None], "clock": np.zeros((len(sess), 1)),
                                "rounds": np.ones((len(sess), 1))}}
                  for f, e, sess, hl, par, snap in segments]
    return t


def test_cold_replay_forks_from_the_parents_replayed_state():
    """For any policy, a forked session starts as a copy of its parent's replayed state (not the engine's
    snapshot of it), and a rollback empties the replayed slots at positions from the new host length on."""
    empty = [[-1] * 4]
    rows = [(0, 0, [1, 2, 3, 4]), (1, 0, [5]),  # LRU: 5 evicts 1; holds 2 3 4 5
            (2, 1, [2, 3, 4, 5]),  # the fork: all hot in its parent's LRU state (the snapshot says 10-13)
            (2, 0, [4, 5, 2])]  # rolled back to 4 host rows: 4 and 5 are gone
    segments = [(0, 2, [0], [50], [-1], empty), (2, 3, [0, 1], [4, 50], [-1, 0], empty + [[10, 11, 12, 13]])]
    t = _with_segments(rows, segments)
    r = policies.replay(t, "lru", 4)
    assert r.total("hits") == 4 + 1 and r.total("misses") == 5 + 2
    # the child's state is its own: the parent's rollback does not empty the child's slots (had they shared
    # arrays, the child would miss 4 and 5 here; above, the parent then hit them, which hid it)
    own = _with_segments(rows[:3] + [(2, 0, [2])], segments)
    assert policies.replay(own, "lru", 4).total("hits") == 4 + 1
    # without a parent the fork starts from the snapshot's positions: 4 misses
    t.segments[1]["parents"] = np.asarray([-1, -1])
    assert policies.replay(t, "lru", 4).total("hits") == 1


def test_a_session_new_to_the_replay_starts_from_the_engines_snapshot():
    """A cold replay starts a session it has not met (no parent) from the engine's snapshot: the engine's policy at
    the engine's size with the engine's memory (LFU's hits and uses), so it still equals a snapshot replay; another
    size with the positions held in slot order; a trace saved before ``host_len`` was kept cuts a rollback at a
    page boundary."""
    held = [(0, 2, [0], [50], [-1], [[10, 11, 12, 13]])]
    t = _with_segments([(0, 0, [20]), (1, 0, [10, 12, 13])], held)
    t.meta["policy"] = "lfu"
    t.segments[0]["snapshot"].update(policy_hits=np.asarray([[[5, 0, 5, 5]]]),
                                     policy_last_use=np.ones((1, 1, 4), np.int64))
    cold, snap = policies.replay(t, "lfu"), policies.replay(t, "lfu", from_snapshots=True)
    assert cold.total("hits") == 3 and cold.per_layer == snap.per_layer  # 20 evicts 11, the row never hit
    assert policies.replay(_with_segments([(0, 0, [10, 11])], held), "lru", 2).total("hits") == 2  # 12, 13 don't fit
    # a rollback between the calls, recorded (host_len 48) or inferred from the start of 50 rows, to a whole page
    empty = [[-1] * 4]
    rows = [(0, 0, [46, 47, 48, 49]), (1, 0, [46, 47, 48, 49])]
    t = _with_segments(rows, [(0, 1, [0], [50], [-1], empty), (1, 2, [0], [48], [-1], empty)])
    assert policies.replay(t, "lru", 4).total("hits") == 2
    for seg in t.segments:
        del seg["host_len"]
    assert policies.replay(t, "lru", 4).total("hits") == 2


def test_empty_slots_are_filled_before_any_eviction():
    """Ranked policies take empty slots first whatever their keys: slots a rollback emptied (whose memory stays)
    and a policy whose keys are negative (the exact path)."""
    empty = [[-1] * 4]
    rows = [(0, 0, [1, 2, 3, 4]), (1, 0, [3, 4]),
            (2, 0, [0]),  # rolled back to 3 rows: 3 and 4 are gone, their slots the most recently used
            (3, 0, [1, 2])]
    t = _with_segments(rows, [(0, 2, [0], [50], [-1], empty), (2, 4, [0], [3], [-1], empty)])
    assert policies.replay(t, "lru", 4).total("hits") == 2 + 2

    class MostRecentFirst(policies.Ranked):
        name = "mru"

        def key(self, st, t, start, window):
            return -st.last_use

    assert policies.replay(_synthetic([[1, 2, 3], [4], [1, 2, 3]]), MostRecentFirst(4, 4096)).total("hits") == 3


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
    assert np.array_equal(_table(policies.replay(trace, "lfu")), want)  # cold, rollback and fork applied
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
    with pytest.raises(TypeError, match="trace must be a glm53.trace.TraceRecorder, got SelectionTrace"):
        e.generate({s: 2}, trace=SelectionTrace.__new__(SelectionTrace))  # the recording, not the recorder


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


def test_positions_outside_the_history_are_refused():
    """A valid host lookup outside [0, capacity) is an error naming its record (a replay would alias it onto
    another row and count made-up hits); invalid and ring entries may hold anything."""
    rows = [(s, 0, 0, 1000, np.arange(s * 10, s * 10 + 10)) for s in range(100)]
    with pytest.raises(ValueError, match=r"record 10 \(step 10, layer 0, session 0\) looks up position 100, "
                                         r"outside the history \[0, 100\)"):
        SelectionTrace.from_rounds(rows, meta={"capacity": 100})
    with pytest.raises(ValueError, match="position -5"):
        SelectionTrace.from_rounds([(0, 0, 0, 10, [3]), (1, 0, 0, 10, [-5, 3])], meta={"capacity": 100})
    with pytest.raises(ValueError, match="capacity"):
        SelectionTrace.from_rounds(rows, meta={})
    t = SelectionTrace.from_rounds([(0, 0, 0, 10, [3, 4])], meta={"capacity": 100})
    t2 = SelectionTrace(**{**t.__dict__, "positions": np.asarray([3, 500], np.int32),
                           "valid": np.asarray([True, False])})
    assert policies.replay(t2, "lru", 4).total("misses") == 1


def test_hot_rows_are_checked_with_a_clear_message():
    t = _synthetic([np.arange(32)] * 3, capacity=256)
    for bad in (0, -5):
        with pytest.raises(ValueError, match=f"hot_rows must be >= 1, got {bad}"):
            policies.replay(t, "lru", bad)
    calls = []
    real = policies.replay
    try:
        policies.replay = lambda *a, **k: calls.append(a) or real(*a, **k)
        with pytest.raises(ValueError, match="hot_rows must be >= 1, got 0"):
            policies.sweep(t, ["lru"], [64, 0])
    finally:
        policies.replay = real
    assert not calls  # refused before any replay
    with pytest.raises(ValueError, match=r"hot_rows=512 exceeds the trace's capacity \(256 rows"):
        policies.replay(t, "lru", 512)
    assert policies.replay(t, "lru", 256).total("misses") == 32
    with pytest.raises(ValueError, match="this trace .* has none: replay it cold"):
        policies.replay(t, "lru", 64, from_snapshots=True)


def test_added_policies_plug_in_and_are_held_to_the_contract():
    """``register`` makes a name usable wherever a built-in's is (with +prefetch); an instance replays as itself;
    huge ranking keys still order exactly; a policy returning bad victims is named in the error."""
    class _PinFirst(policies.Ranked):
        """Keeps positions below ``pinned_rows`` (attention sinks), LRU among the rest."""

        name = "pinfirst"

        def __init__(self, hot_rows, capacity, pinned_rows=4):
            super().__init__(hot_rows, capacity)
            self.pinned_rows = pinned_rows

        def key(self, st, t, start, window):
            sink = (st.position_of_slot >= 0) & (st.position_of_slot < self.pinned_rows)
            return np.where(sink, np.int64(1) << 61, st.last_use)  # * hot_rows would overflow: the exact slow path

    sinks = np.arange(4)
    t = _synthetic([np.concatenate([sinks, 100 + np.arange(t * 8, t * 8 + 8)]) if t % 5 == 0
                    else 100 + np.arange(t * 8, t * 8 + 8) for t in range(50)])
    policies.register("pinfirst4", lambda h, n: _PinFirst(h, n, 4), replace=True)
    pin, lru = policies.replay(t, "pinfirst4", 16), policies.replay(t, "lru", 16)
    assert pin.policy == "pinfirst4" and pin.total("hits") == 4 * 9 and lru.total("hits") == 0
    assert policies.replay(t, _PinFirst(16, 4096), None).per_layer == pin.per_layer
    res = policies.sweep(t, ["pinfirst4+prefetch2", _PinFirst(32, 4096)], [16, 64])
    assert [(r.policy, r.hot_rows) for r in res] == [("pinfirst4+prefetch2", 16), ("pinfirst4+prefetch2", 64),
                                                      ("pinfirst", 32)]
    with pytest.raises(ValueError, match="registered already"):
        policies.register("pinfirst4", lambda h, n: _PinFirst(h, n))
    with pytest.raises(ValueError, match="not a name for a new policy"):
        policies.register("lru", lambda h, n: _PinFirst(h, n))

    class Slot0(policies.Policy):
        name = "slot0"

        def victims(self, st, n, pinned, t, start, window):
            return np.zeros(n, np.int64), 1

    with pytest.raises(ValueError, match="policy 'slot0': victims\\(\\) returned a slot more than once"):
        policies.replay(t, Slot0(16, 4096))

    class Pinned(policies.Policy):
        name = "pinned"

        def victims(self, st, n, pinned, t, start, window):
            return np.flatnonzero(pinned)[:n] if pinned.any() else np.arange(n), 1

    with pytest.raises(ValueError, match="policy 'pinned': victims\\(\\) returned slot .*pinned this round"):
        policies.replay(_synthetic([np.arange(8), np.arange(4, 12)]), Pinned(16, 4096))
    # the overflow guard: a key of 2**50 on the slot holding position 0 must keep it, even with 8,192 slots
    keep0 = _PinFirst(8192, 100_000, pinned_rows=1)
    st_ = keep0.new_state()
    st_.load(np.arange(8192), 0)
    st_.last_use[:] = 5
    victim, _ = keep0.victims(st_, 1, np.zeros(8192, bool), 10, 100_000, 1)
    assert st_.position_of_slot[victim].tolist() == [1]


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
    # ... but a prefetched row is read from host memory too: the headline counts it, and it reads more here
    d = pre.to_dict()
    assert d["host_rows"] == pre.total("misses") + pre.total("prefetched") and d["host_bytes"] == 656 * d["host_rows"]
    assert pre.host_rows > base.host_rows
    # prefetch fills search apart from demand fills: the demand searches are the rounds that missed
    assert d["scan"]["rounds"] == base.scan["rounds"] and d["prefetch_scan"]["rounds"] > 0


class _SecondChance(policies.Policy):
    """Clock as the textbook has it, one victim at a time: the hand passes pinned slots, clears a set bit and
    moves on, and takes the first unpinned slot that is empty or whose bit is clear."""

    name = "second-chance"

    def touch(self, st, slots, t):
        st.ref[slots] = True

    def filled(self, st, slots, t):
        st.ref[slots] = True

    def victims(self, st, n, pinned, t, start, window):
        pinned, taken, looked = pinned.copy(), [], 0
        for _ in range(min(n, int(np.count_nonzero(~pinned)))):
            while True:
                s, st.clock = st.clock, (st.clock + 1) % self.H
                looked += 1
                if pinned[s]:
                    continue
                if st.position_of_slot[s] < 0 or not st.ref[s]:
                    break
                st.ref[s] = False
            taken.append(s)
            pinned[s] = True
        return np.asarray(taken, np.int64), looked


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(4, 24), st.integers(0, 2**31 - 1))
def test_clock_is_second_chance(hot, seed):
    """The clock policy's vectorized search equals the one-victim-at-a-time second chance on random rounds with
    repeats and hits (the bits hits set, the bits the hand clears, full passes): the same counts and search
    lengths. Rounds of at most half the cache always leave a victim for every miss."""
    rng = np.random.default_rng(seed)
    t = _synthetic([rng.integers(0, 3 * hot, rng.integers(1, hot // 2 + 1)) for _ in range(40)])
    clock, textbook = policies.replay(t, "clock", hot), policies.replay(t, _SecondChance(hot, 4096))
    assert clock.per_layer == textbook.per_layer and clock.scan == textbook.scan


def test_window_sticky_keeps_the_window_then_the_often_hit_rows():
    """window<W>+sticky: a row among the session's last W positions stays while others exist, even never hit
    and the least recently used; among the others the least often hit goes first, then the least recent."""
    recent = 4096 - 10  # the oldest of window10's rows in a session of 4,096
    t = _synthetic([[recent, 1, 2, 3], [1], [1], [2, 3],
                    [5],  # evicts 2: not recent, hit once and longer ago than 3 (1 was hit twice)
                    [recent, 1, 3]])
    assert policies.replay(t, "window10+sticky", 4).total("hits") == 4 + 3
    assert policies.replay(t, "lru", 4).total("hits") == 4 + 2  # recency alone drops the window's row


def test_prefetch_reads_only_rows_in_host_memory_within_its_budget():
    """+prefetch<P> brings in at most P neighbours of a round's misses, only rows surely in host memory (below the
    ring rows the round read and the page before the last), and never evicts a row the same round read or
    brought in."""
    def hot_after(pos, ring=(), start=96):  # one round of lru+prefetch2 over 8-row pages
        pol = policies.make("lru+prefetch2", 16, 200)
        pol.page_rows = 8
        stt, counts = pol.new_state(), np.zeros(len(policies.COUNTS), np.int64)
        pos = np.asarray(pos)
        pol.round(stt, pos, np.ones(pos.size, bool), np.isin(pos, ring), start, 0, counts, [], [])
        return sorted(stt.position_of_slot[stt.position_of_slot >= 0].tolist())

    assert hot_after([10, 30]) == [9, 10, 11, 30]  # 29 and 31 past the budget
    assert hot_after([79]) == [78, 79]  # 80-95: the last two pages of 96 rows
    assert hot_after([60, 61], ring=[61]) == [59, 60]  # 61 is in the ring
    # every slot pinned by the round's hits and fills: nothing to prefetch into
    t = _synthetic([[1, 2, 3, 4], [1, 2, 3, 10], [10]])
    for spec in ("circular", "clock", "lru", "lfu", "window8+sticky"):
        r = policies.replay(t, spec + "+prefetch2", 4)
        assert r.total("prefetched") == 0 and r.total("hits") == 3 + 1, spec


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


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**31 - 1), st.integers(1, 3))
def test_lfu_round_equals_the_engines_fill(seed, rounds):
    """The simulator's LFU against the engine's (``OffloadCache``'s LFU keys and update around
    ``fill_round_reference``) from the same random state: hit counts and ages at and past the engine's caps (1,023
    hits, 2**21 - 1 rounds), invalid entries (they pin but are not uses), ring entries, repeats; the maps and the
    policy's memory agree after every round."""
    import types

    from glm53.offload import LFU_MAX_AGE, LFU_MAX_HITS, OffloadCache
    from kernels_pallas.fill_round import fill_round_reference
    from kernels_pallas.hot_gather import HOST, HOT, RING

    rng = np.random.default_rng(seed)
    H, N, M = 16, 64, 6  # the engine searches the first M + M slots in key order, fewer than H
    pos_of_slot = np.full(H, -1, np.int64)
    held = rng.permutation(N)[: H - rng.integers(0, 3)]
    pos_of_slot[rng.permutation(H)[: held.size]] = held
    now = int(rng.choice([5, LFU_MAX_AGE + 10, 3 * LFU_MAX_AGE]))  # rounds so far
    # a nearly full cache of counts mostly at or past the cap: the first round's victims are among them, where
    # only the cap makes the ages decide
    hits = rng.choice([0, 1, LFU_MAX_HITS - 1, LFU_MAX_HITS, LFU_MAX_HITS + 1, 5000], H,
                      p=[0.04, 0.03, 0.03, 0.3, 0.3, 0.3])
    last_use = np.maximum(now - rng.choice([0, 1, 3, LFU_MAX_AGE, LFU_MAX_AGE + 1, 2 * LFU_MAX_AGE], H), 0)
    pol = policies.make("lfu", H, N)
    stt = pol.new_state()
    stt.load(pos_of_slot, 0, now, hits, last_use)
    sop = np.full(N, -1, np.int32)
    sop[pos_of_slot[pos_of_slot >= 0]] = np.flatnonzero(pos_of_slot >= 0)
    cache = types.SimpleNamespace(
        hot_rows=H, num_slots=1, rounds=jnp.full((1, 1), now, jnp.int32),
        position_of_slot=jnp.asarray(pos_of_slot[None, None], jnp.int32),
        policy_state={"hits": jnp.asarray(hits[None, None], jnp.int32),
                      "last_use": jnp.asarray(last_use[None, None], jnp.int32)})
    cache._lane_index = lambda layers, lanes: OffloadCache._lane_index(cache, layers, lanes)
    lanes = types.SimpleNamespace(slot=jnp.zeros((1,), jnp.int32), active=jnp.ones((1,), bool))
    # the fill donates its maps, and the engine's LFU reads the state from before it: copies
    maps = {"pin_round": jnp.full((1, 1, H), -1, jnp.int32), "position_of_slot": jnp.copy(cache.position_of_slot),
            "slot_of_position": jnp.asarray(sop[None, None], jnp.int32), "rounds": jnp.copy(cache.rounds),
            "clock": jnp.zeros((1, 1), jnp.int32), "counters": jnp.zeros((1, 1, 5), jnp.int32)}
    counts = np.zeros(len(policies.COUNTS), np.int64)
    for t in range(rounds):
        pos = rng.integers(0, N, M)
        valid = rng.random(M) < 0.8
        in_ring = rng.random(M) < 0.1
        slot = np.asarray(maps["slot_of_position"])[0, 0][pos]
        source = np.where(in_ring, RING, np.where(slot >= 0, HOT, HOST))
        r = {"pos": jnp.asarray(pos[None], jnp.int32), "source": jnp.asarray(source[None], jnp.int32),
             "slot": jnp.asarray(slot[None], jnp.int32), "valid": jnp.asarray(valid[None])}
        keys = OffloadCache._lfu_keys(cache, (0,), lanes)
        maps, _, victim, n_fill = fill_round_reference(maps, (r,), lanes.slot, lanes.active, layers=(0,),
                                                       hot_rows=H, distinct=False, max_repeats=M, victim_keys=keys)
        cache.policy_state = OffloadCache._lfu_update(cache, (0,), [types.SimpleNamespace(**r)], lanes, victim,
                                                      n_fill)
        cache.rounds, cache.position_of_slot = jnp.copy(maps["rounds"]), jnp.copy(maps["position_of_slot"])
        pol.round(stt, pos, valid, in_ring, N, t, counts, [])
        assert np.array_equal(np.asarray(maps["position_of_slot"])[0, 0], stt.position_of_slot)
        assert np.asarray(maps["counters"])[0, 0].tolist() == counts[:5].tolist()
        assert np.array_equal(np.asarray(cache.policy_state["hits"])[0, 0], stt.freq)
        assert np.array_equal(np.asarray(cache.policy_state["last_use"])[0, 0], stt.last_use)


def _sweep(*args):
    from pathlib import Path

    import python_runner

    return python_runner.run(["-m", "experiments.policy_sweep", *args],
                             cwd=Path(__file__).resolve().parents[1], timeout=600)


def test_policy_sweep_refuses_what_it_would_ignore_before_recording():
    """A flag the sweep cannot use, or a config override it would not read, ends it with one line naming it,
    before the model trace is recorded."""
    for args, message in ((["--hot_rows=abc"], "--hot_rows=abc: 'abc' is not a whole number"),
                          (["--workloads=foo"], "--workloads=foo: unknown workload 'foo'"),
                          (["--workloads=model", "--config.run.batch=3", "--config.run.temperature=0.9",
                            "--config.mesh.stages=2"], r"--config.mesh.stages=2: the model trace reads"),
                          (["--workloads=uniform", "--config.run.batch=3"],
                           "--config.run.batch=3: no 'model' workload runs"),
                          (["--workloads=model", "--model_hot_rows=256,512"],
                           r"--model_hot_rows=256,512: 512 exceeds the model trace's capacity \(384 rows")):
        p = _sweep(*args)
        last = p.stderr.strip().splitlines()[-1]
        assert p.returncode == 1 and "Traceback" not in p.stderr and "trace {" not in p.stdout, p.stderr[-2000:]
        assert re.search("^experiments.policy_sweep: " + message, last), last


def test_policy_sweep_checks_the_engines_own_policy(tmp_path):
    """The model trace of an LFU engine (the check replayed the engine's policy, whatever it was, as circular):
    replayed from the snapshots and cold, both equal the engine's counters; the JSON reports rows from host."""
    out = tmp_path / "ps.json"
    p = _sweep("--workloads=model", "--config.cache.policy=lfu", "--config.run.max_new_tokens=3",
               "--config.run.prompt_len=100", "--config.model.num_hidden_layers=2",
               "--config.model.indexer_types=('full','shared')", "--policies=circular,lfu+prefetch4", f"--out={out}")
    assert p.returncode == 0, p.stderr[-3000:]
    report = json.loads(out.read_text())["workloads"]["model"]
    check = report["engine_check"]
    assert check["policy"] == "lfu" and check["replayed_equal"] and check["cold_equal"]
    assert all(r["host_rows"] == r["misses"] + r["prefetched"] for r in report["results"])
