"""Hot-cache replacement policies replayed offline over selection traces (``glm53.trace``): hit rate, bytes from
host memory and victim-search lengths for any policy and hot-cache size, on a CPU, in seconds.

Every policy sees a trace the way the engine's fill does (``kernels_pallas.fill_round``), one round per (step,
layer, session):

1. classify: an entry served by the ring (``in_ring``) is neither hit nor miss; otherwise it hits when its position
   holds a hot slot, else it misses. Only ``valid`` entries count (hits, misses, ring reads), but every hit pins
   its slot for the round (as the engine's pin stamps do);
2. fill: the round's missed positions, each once at its first valid entry, in entry order, go to victim slots
   the policy chooses among the unpinned ones, at most ``min(entries, hot_rows)`` per round; a victim's old
   position is evicted.

The policies differ only in the choice of victims and what they remember:

- ``circular`` (the engine's): the first unpinned slots in circular order from a clock that moves past the last
  victim, searched in a window of ``min(H, entries + fills)`` slots. A replay from a recorded trace's snapshots
  reproduces the engine's counters exactly (``tests/test_policies.py``).
- ``clock``: second chance. A slot's reference bit is set when it is hit or filled; the hand clears set bits as it
  passes and takes the first unpinned slot whose bit is clear. This is the policy the article measured at ~1 ms per
  gather in a pathological case: when most slots were referenced since the hand last passed, one search walks most
  of the cache (``scan`` in the results counts the slots examined).
- ``lru``: the unpinned slots used longest ago (hit or filled).
- ``lfu``: the unpinned slots hit least often since they were filled (ties: least recently used, then the lower
  slot), the engine's ``CacheConfig.policy="lfu"`` exactly (counts and ages capped as it caps them).
- ``window<W>+sticky``: rows among the last ``W`` positions of the session are kept while others exist; among the
  rest the least often hit go first (the "sticky" rows a session keeps returning to stay), then LRU.
- ``<policy>+prefetch<P>``: after each round, up to ``P`` positions next to the round's misses (p - 1, p + 1) that
  are neither hot nor in the ring are brought in ahead of need, through the same policy's victims. Prefetched rows
  are reported apart (``prefetched``, ``prefetch_bytes``); a later hit on one is an ordinary hit.

Empty slots are always chosen before occupied ones, except by ``circular``, which follows its clock.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from glm53.offload import COUNTERS, LFU_MAX_AGE, LFU_MAX_HITS

COUNTS = COUNTERS + ("prefetched",)  # the engine's counters, then rows a prefetch brought in
POLICIES = "circular | clock | lru | lfu | window<W>+sticky (e.g. window4096+sticky) | <any>+prefetch<P>"
_BIG = np.int64(1) << 62


@dataclasses.dataclass
class ReplayResult:
    """One policy at one hot-cache size over one trace. ``per_layer[name]``: counts per layer (``COUNTS``) in the
    trace's layer order ``layers``; ``scan``: slots examined per round that filled anything."""

    policy: str
    hot_rows: int
    layers: list
    per_layer: dict
    scan: dict
    row_bytes: int
    seconds: float = 0.0

    def total(self, name: str) -> int:
        return int(np.sum(self.per_layer[name]))

    @property
    def hit_rate(self) -> float | None:
        n = self.total("hits") + self.total("misses")
        return self.total("hits") / n if n else None

    @property
    def bytes_from_host(self) -> int:
        return self.total("misses") * self.row_bytes

    @property
    def prefetch_bytes(self) -> int:
        return self.total("prefetched") * self.row_bytes

    def to_dict(self) -> dict:
        return {"policy": self.policy, "hot_rows": self.hot_rows, "hit_rate": self.hit_rate,
                **{n: self.total(n) for n in COUNTS}, "bytes_from_host": self.bytes_from_host,
                "prefetch_bytes": self.prefetch_bytes, "scan": self.scan, "layers": self.layers,
                "per_layer": {k: [int(x) for x in v] for k, v in self.per_layer.items()}, "seconds": self.seconds}


# ----------------------------------------------------------------------------------------------------------------
# State of one (layer, session): which position each slot holds, and what the policy remembers
# ----------------------------------------------------------------------------------------------------------------
class _State:
    __slots__ = ("slot_of_position", "position_of_slot", "clock", "rounds", "ref", "last_use", "freq")

    def __init__(self, hot_rows: int, capacity: int):
        self.slot_of_position = np.full(capacity, -1, np.int32)
        self.position_of_slot = np.full(hot_rows, -1, np.int64)
        self.clock = 0
        self.rounds = 0  # rounds of this (layer, session), as the engine counts them
        self.ref = np.zeros(hot_rows, bool)
        self.last_use = np.zeros(hot_rows, np.int64)
        self.freq = np.zeros(hot_rows, np.int64)

    def load(self, position_of_slot: np.ndarray, clock: int, rounds: int = 0, hits=None, last_use=None) -> None:
        """Start from an engine snapshot (``glm53.trace`` segments); LFU's counts when the engine kept them."""
        pos = np.asarray(position_of_slot, np.int64)
        self.slot_of_position[:] = -1
        held = np.flatnonzero(pos >= 0)
        self.slot_of_position[pos[held]] = held
        self.position_of_slot[:] = pos
        self.clock, self.rounds = int(clock), int(rounds)
        if hits is not None:
            self.freq[:] = hits
            self.last_use[:] = last_use


class Policy:
    """Base: the round mechanics. Subclasses choose victims (``_victims``) and may remember hits and fills."""

    name = "base"
    prefetch = 0
    page_rows = 0  # the trace's page size, for prefetch: 0 when the trace has no ring (synthetic)

    def __init__(self, hot_rows: int, capacity: int):
        self.H, self.N = int(hot_rows), int(capacity)

    def new_state(self) -> _State:
        return _State(self.H, self.N)

    # ---- hooks ----
    def _victims(self, st: _State, n: int, pinned: np.ndarray, t: int, start: int, window: int) -> tuple:
        """Up to ``n`` victim slots (an array) and the slots examined to find them."""
        raise NotImplementedError

    def _touch(self, st: _State, slots: np.ndarray, t: int) -> None:
        """Slots hit this round (valid entries, each slot once)."""

    def _filled(self, st: _State, slots: np.ndarray, t: int) -> None:
        """Slots just filled."""

    # ---- a round ----
    def round(self, st: _State, pos: np.ndarray, valid: np.ndarray, in_ring: np.ndarray, start: int, step: int,
              counts: np.ndarray, scans: list) -> None:
        """One round of one (layer, session) at trace step ``step``; adds to ``counts`` (``COUNTS`` order) and
        appends to ``scans``. Policies stamp uses with the state's own round (``t``), as the engine does."""
        H, N = self.H, self.N
        t = st.rounds + 1
        p = np.clip(pos, 0, N - 1)
        slot = st.slot_of_position[p]
        hit = ~in_ring & (slot >= 0)
        miss = ~in_ring & (slot < 0)
        counts[0] += np.count_nonzero(hit & valid)
        counts[1] += np.count_nonzero(miss & valid)
        counts[2] += np.count_nonzero(in_ring & valid)
        pinned = np.zeros(H, bool)
        pinned[slot[hit]] = True
        touched = np.unique(slot[hit & valid])
        if touched.size:
            self._touch(st, touched, t)
        wanted = np.flatnonzero(miss & valid)
        if wanted.size:
            # each missed position once, at its first valid entry, in entry order
            _, first = np.unique(p[wanted], return_index=True)
            new = p[wanted[np.sort(first)]]
            self._fill(st, new, pinned, min(pos.size, H), t, start, counts, scans, window=pos.size)
        if self.prefetch and wanted.size:
            self._prefetch(st, p[wanted], pinned, in_ring, pos, start, t, counts, scans)
        st.rounds = t

    def _fill(self, st, new, pinned, F, t, start, counts, scans, window, prefetch=False):
        n = min(new.size, F)
        victims, scanned = self._victims(st, n, pinned, t, start, window)
        k = min(n, victims.size)
        if not k:
            return 0
        victims, new = victims[:k], new[:k]
        old = st.position_of_slot[victims]
        gone = old[old >= 0]
        st.slot_of_position[gone] = -1
        counts[4] += gone.size
        st.slot_of_position[new] = victims
        st.position_of_slot[victims] = new
        counts[5 if prefetch else 3] += k
        pinned[victims] = True  # a row just brought in is not a victim again in the same round
        self._filled(st, victims, t)
        scans.append(scanned)
        return k

    def _prefetch(self, st, missed, pinned, in_ring, pos, start, t, counts, scans):
        # Only rows surely in host memory: below the ring's rows this round saw, and below the page before the
        # session's last complete one (the copyback may not have written that yet).
        host_end = start if not self.page_rows else max(0, ((start - 1) // self.page_rows - 1) * self.page_rows)
        if in_ring.any():
            host_end = min(host_end, int(pos[in_ring].min()))
        cand = np.concatenate([missed - 1, missed + 1])
        cand = cand[(cand >= 0) & (cand < host_end) & (cand < self.N)]
        cand = np.unique(cand)
        cand = cand[st.slot_of_position[cand] < 0][: self.prefetch]
        if cand.size:
            self._fill(st, cand, pinned, cand.size, t, start, counts, scans, window=cand.size, prefetch=True)


class Circular(Policy):
    """The engine's victim search (``kernels_pallas.fill_round``)."""

    name = "circular"

    def _victims(self, st, n, pinned, t, start, window):
        H = self.H
        W = min(H, window + min(window, H))
        slot_at = (st.clock + np.arange(W)) % H
        free = np.flatnonzero(~pinned[slot_at])[:n]
        if not free.size:
            return free, 0
        st.clock = int((slot_at[free[-1]] + 1) % H)
        return slot_at[free], int(free[-1]) + 1


class Clock(Policy):
    name = "clock"

    def _touch(self, st, slots, t):
        st.ref[slots] = True

    def _filled(self, st, slots, t):
        st.ref[slots] = True

    def _victims(self, st, n, pinned, t, start, window):
        H = self.H
        order = (st.clock + np.arange(H)) % H
        cand = ~pinned[order]
        empty = st.position_of_slot[order] < 0
        first = np.flatnonzero(cand & (~st.ref[order] | empty))
        if first.size >= n:
            take = first[:n]
            examined = int(take[-1]) + 1 if take.size else 0
            passed = order[:examined]
            st.ref[passed[cand[:examined]]] = False
        else:  # a full pass clears every unpinned bit; the second pass takes the rest in order
            st.ref[order[cand]] = False
            rest = np.setdiff1d(np.flatnonzero(cand), first, assume_unique=True)[: n - first.size]
            take = np.concatenate([first, rest])
            examined = H + (int(rest[-1]) + 1 if rest.size else 0)
        if not take.size:
            return take, examined
        st.clock = int((order[take[-1]] + 1) % H)
        return order[take], examined


class _Ranked(Policy):
    """Victims: the unpinned slots with the smallest key (empty slots first)."""

    def _key(self, st, t, start, window) -> np.ndarray:
        """Rank of each occupied slot this round (``t``): smallest first. Keys below 2**40."""
        raise NotImplementedError

    def _touch(self, st, slots, t):
        st.last_use[slots] = t
        st.freq[slots] += 1

    def _filled(self, st, slots, t):
        st.last_use[slots] = t
        st.freq[slots] = 0

    def _victims(self, st, n, pinned, t, start, window):
        key = np.where(st.position_of_slot < 0, -1, self._key(st, t, start, window)).astype(np.int64)
        n = min(n, int(np.count_nonzero(~pinned)))
        if n <= 0:
            return np.zeros(0, np.int64), 0
        # by key, ties to the lower slot (the engine's stable sort): one exact int64 order, partitioned then sorted
        order = key * self.H + np.arange(self.H)
        order[pinned] = np.iinfo(np.int64).max
        part = np.argpartition(order, n - 1)[:n] if n < order.size else np.arange(order.size)
        return part[np.argsort(order[part])], self.H  # a ranked choice looks at every slot


class LRU(_Ranked):
    name = "lru"

    def _key(self, st, t, start, window):
        return st.last_use


class LFU(_Ranked):
    """The engine's LFU (``CacheConfig.policy="lfu"``, ``glm53.offload``): hits since the fill capped at 1,023,
    then age in rounds capped at 2**21 - 1 (older first), then the lower slot."""

    name = "lfu"

    def _key(self, st, t, start, window):
        hits = np.minimum(st.freq, LFU_MAX_HITS)
        age = np.clip(t - st.last_use, 0, LFU_MAX_AGE)
        return (hits << 21) | (LFU_MAX_AGE - age)


class WindowSticky(_Ranked):
    def __init__(self, hot_rows, capacity, window: int):
        super().__init__(hot_rows, capacity)
        self.window = int(window)
        self.name = f"window{self.window}+sticky"

    def _key(self, st, t, start, window):
        recent = (st.position_of_slot >= start - self.window).astype(np.int64)
        return (recent << 39) | (np.minimum(st.freq, (1 << 16) - 1) << 23) | np.minimum(st.last_use, (1 << 23) - 1)


_BASE = {"circular": Circular, "clock": Clock, "lru": LRU, "lfu": LFU}


def make(spec: str, hot_rows: int, capacity: int) -> Policy:
    """A policy from its name (``POLICIES``)."""
    m = re.fullmatch(r"(circular|clock|lru|lfu|window(\d+)\+sticky)(\+prefetch(\d+))?", spec)
    if not m:
        raise ValueError(f"unknown policy {spec!r}; choose from {POLICIES}")
    if hot_rows < 1:
        raise ValueError(f"hot_rows must be >= 1, got {hot_rows}")
    pol = WindowSticky(hot_rows, capacity, int(m.group(2))) if m.group(2) else _BASE[m.group(1)](hot_rows, capacity)
    if m.group(4):
        pol.prefetch = int(m.group(4))
        pol.name = f"{pol.name}+prefetch{pol.prefetch}"
    return pol


def replay(trace, spec: str = "circular", hot_rows: int | None = None, *, from_snapshots: bool = False) -> ReplayResult:
    """Replay ``trace`` (a ``glm53.trace.SelectionTrace``) through the policy ``spec`` with ``hot_rows`` slots per
    (layer, session) (default: the recording engine's). Every state starts empty, or with ``from_snapshots`` (the
    engine's policy at the engine's size only) from the engine's hot cache at the start of each recorded segment:
    then the counts equal the engine's own."""
    import time

    t0 = time.perf_counter()
    meta = trace.meta
    H = int(hot_rows if hot_rows is not None else (meta.get("hot_rows") or 0))
    if H < 1:
        raise ValueError("replay: give hot_rows (this trace records no engine hot-cache size)")
    N = int(meta["capacity"])
    pol = make(spec, H, N)
    pol.page_rows = int(meta.get("page_rows") or 0)
    if from_snapshots:
        engine_policy = meta.get("policy", "circular")
        if pol.name != engine_policy:
            raise ValueError(f"replay: from_snapshots needs the recording engine's policy ({engine_policy!r}), "
                             f"not {pol.name!r}")
        if meta.get("hot_rows") != H:
            raise ValueError(f"replay: the snapshots hold {meta.get('hot_rows')} slots, not {H}")
        if not trace.segments:
            raise ValueError("replay: this trace has no engine snapshots")
    layers = sorted(set(trace.layer.tolist()))
    col = {l: i for i, l in enumerate(layers)}
    counts = np.zeros((len(layers), len(COUNTS)), np.int64)
    scans: list = []
    states: dict = {}
    seg_starts = {seg["first_step"]: seg for seg in trace.segments} if from_snapshots else {}
    step, layer, session, start = trace.step, trace.layer, trace.session, trace.start
    offset, count = trace.offset, trace.count
    last_step = -1
    for i in range(trace.num_records):
        s = int(step[i])
        if s != last_step:
            for first in [f for f in seg_starts if last_step < f <= s]:
                _load_segment(states, seg_starts[first], pol, layers)
            last_step = s
        key = (int(layer[i]), int(session[i]))
        st = states.get(key)
        if st is None:
            st = states[key] = pol.new_state()
        a, n = int(offset[i]), int(count[i])
        pol.round(st, trace.positions[a:a + n], trace.valid[a:a + n], trace.in_ring[a:a + n], int(start[i]), s,
                  counts[col[key[0]]], scans)
    sc = np.asarray(scans, np.int64)
    scan = {"rounds": int(sc.size), "mean": float(sc.mean()) if sc.size else 0.0,
            "p99": float(np.percentile(sc, 99)) if sc.size else 0.0, "max": int(sc.max()) if sc.size else 0}
    return ReplayResult(policy=pol.name, hot_rows=H, layers=layers,
                        per_layer={n: counts[:, j].tolist() for j, n in enumerate(COUNTS)}, scan=scan,
                        row_bytes=int(meta.get("row_bytes") or 656), seconds=time.perf_counter() - t0)


def _load_segment(states: dict, seg: dict, pol: Policy, layers: list) -> None:
    snap = seg["snapshot"]
    for j, sess in enumerate(seg["sessions"]):
        for l in layers:
            st = states.get((l, sess))
            if st is None:
                st = states[(l, sess)] = pol.new_state()
            lfu = "policy_hits" in snap
            st.load(snap["position_of_slot"][j][l], int(snap["clock"][j][l]), int(snap["rounds"][j][l]),
                    snap["policy_hits"][j][l] if lfu else None, snap["policy_last_use"][j][l] if lfu else None)


def segment_counts(trace) -> np.ndarray:
    """The engine's own counters over the recorded segments, ``[layers, 5]`` (``COUNTS[:5]``), in the trace's layer
    order: what ``replay(..., from_snapshots=True)`` must reproduce."""
    layers = sorted(set(trace.layer.tolist()))
    out = np.zeros((len(layers), 5), np.int64)
    for seg in trace.segments:
        delta = np.asarray(seg["counters_after"], np.int64) - np.asarray(seg["counters_before"], np.int64)
        out += delta.sum(0)[layers]
    return out


def sweep(trace, specs, hot_rows_list, *, progress: bool | None = None) -> list[ReplayResult]:
    """Every policy in ``specs`` at every size in ``hot_rows_list`` (cold start). ``progress``: a bar over the
    replays (True: at once; None: once they have run 2 s; False: none)."""
    from glm53 import progress as progress_lib

    jobs = [(s, h) for s in specs for h in hot_rows_list]
    for s, _ in jobs:
        make(s, 1, 1)  # bad names fail before any work
    return [replay(trace, s, h) for s, h in progress_lib.bar(jobs, progress=progress, desc="policies", leave=False)]
