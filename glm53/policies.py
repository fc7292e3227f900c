"""Hot-cache replacement policies replayed offline over selection traces (``glm53.trace``): hit rate, rows read
from host memory and victim-search lengths for any policy and hot-cache size, on a CPU, in seconds.

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
  reproduces the engine's counters exactly, and so does a cold replay (``tests/test_policies.py``).
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
  are neither hot nor in the ring are brought in ahead of need, through the same policy's victims. A prefetched
  row is read from host memory like a miss: ``host_rows`` (misses + prefetched) and ``host_bytes`` count both and
  are what to compare policies by (a later hit on a prefetched row is an ordinary hit, so ``hit_rate`` alone
  flatters a prefetch). Prefetch fills' victim searches are reported apart (``prefetch_scan``) from the demand
  fills' (``scan``).

Empty slots are always chosen before occupied ones, except by ``circular``, which follows its clock.

**Between generate calls.** A recorded trace has one segment per ``Engine.generate`` call; between two the engine
may have rolled a session back (its hot slots at positions past the new ``host_len`` emptied) or forked one (the
child's hot cache a copy of the parent's). A cold replay applies the same to every policy's own state at each
segment's start: a session it has replayed before loses the rows at positions ``>= host_len``; a session new to the
replay starts as a copy of its parent's replayed state when the trace names a parent (then cut at its own
``host_len``), else from the engine's snapshot of it: the positions it held (placed in slot order when the sizes
differ), the engine's round count and, at the engine's size, its clock; the policy's own memory (reference bits,
uses, hits) empty unless it is the engine's policy at the engine's size and the snapshot holds that memory. A fresh
session's snapshot is empty, so it starts empty. Traces saved before ``host_len`` and ``parents`` were recorded
infer ``host_len`` from each session's first step in the segment (its start position, down to a page) and start
every new session from its snapshot.

**Adding a policy.** Subclass ``Policy`` (or ``Ranked``, for "the unpinned slots with the smallest key") and either
pass an instance to ``replay`` / ``sweep`` or ``register(name, factory)`` it: ``factory(hot_rows, capacity)``
returns the policy, and the name is then usable wherever a built-in's is (``make``, ``replay``, ``sweep``,
``experiments.policy_sweep --policies``), ``+prefetch<P>`` included. The hooks, called with the (layer, session)'s
``State`` ``st`` (``position_of_slot [H]``, ``slot_of_position [capacity]``, ``clock``, ``rounds`` and memory the
built-ins use: ``ref``, ``last_use``, ``freq``, all ``[H]``; a subclass may keep more by overriding ``new_state``)
and the round's number ``t`` (1, 2, ... per (layer, session), as the engine counts):

- ``victims(st, n, pinned, t, start, window) -> (slots, examined)``: at most ``n`` victim slots, distinct, in
  ``[0, H)``, none ``pinned`` (``[H]`` bool: hit or filled this round), in the order the round's new positions take
  them; ``examined``: the slots looked at to find them (the victim-search length). Fewer than ``n`` leaves the rest
  of the round's misses unfilled. Anything else is a ``ValueError`` naming the policy. ``start``: the session's first
  position this step (its history length); ``window``: the round's entries.
- ``touch(st, slots, t)``: the slots hit this round (valid entries, each slot once). Optional.
- ``filled(st, slots, t)``: the slots just filled. Optional.
- ``Ranked.key(st, t, start, window) -> [H] int``: the rank of each occupied slot this round, smallest evicted
  first (ties to the lower slot); empty slots go first whatever their key. Any int64 keys are ordered exactly
  (keys below ``2**62 / H`` take the fast path).

The hooks mutate ``st``; the mechanics (classification, pins, the fill's bookkeeping, prefetch, counts) stay
``Policy.round``'s. The hooks of versions before these were public were ``_victims``, ``_touch``, ``_filled`` and
``_key``.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import time
from typing import Callable

import numpy as np

from glm53.offload import COUNTERS, LFU_MAX_AGE, LFU_MAX_HITS

COUNTS = COUNTERS + ("prefetched",)  # the engine's counters, then rows a prefetch brought in
POLICIES = ("circular | clock | lru | lfu | window<W>+sticky (e.g. window4096+sticky) | a registered name "
            "(policies.register) | <any>+prefetch<P>")


def _scan_summary(scans) -> dict:
    sc = np.asarray(scans, np.int64)
    return {"rounds": int(sc.size), "mean": float(sc.mean()) if sc.size else 0.0,
            "p99": float(np.percentile(sc, 99)) if sc.size else 0.0, "max": int(sc.max()) if sc.size else 0}


@dataclasses.dataclass
class ReplayResult:
    """One policy at one hot-cache size over one trace. ``per_layer[name]``: counts per layer (``COUNTS``) in the
    trace's layer order ``layers``; ``scan``: slots examined per round whose demand fill (its misses) filled
    anything; ``prefetch_scan``: the same for prefetch fills."""

    policy: str
    hot_rows: int
    layers: list
    per_layer: dict
    scan: dict
    row_bytes: int
    seconds: float = 0.0
    prefetch_scan: dict = dataclasses.field(default_factory=lambda: _scan_summary([]))

    def total(self, name: str) -> int:
        return int(np.sum(self.per_layer[name]))

    @property
    def hit_rate(self) -> float | None:
        """Hits among the looked-up host rows (ring reads apart); None when nothing was looked up. Prefetched rows
        are not lookups: compare policies with prefetch by ``host_rows``."""
        n = self.total("hits") + self.total("misses")
        return self.total("hits") / n if n else None

    @property
    def host_rows(self) -> int:
        """Rows read from host memory: the misses and the prefetched rows."""
        return self.total("misses") + self.total("prefetched")

    @property
    def host_bytes(self) -> int:
        return self.host_rows * self.row_bytes

    @property
    def miss_bytes(self) -> int:
        return self.total("misses") * self.row_bytes

    @property
    def prefetch_bytes(self) -> int:
        return self.total("prefetched") * self.row_bytes

    def to_dict(self) -> dict:
        return {"policy": self.policy, "hot_rows": self.hot_rows, "hit_rate": self.hit_rate,
                **{n: self.total(n) for n in COUNTS}, "host_rows": self.host_rows, "host_bytes": self.host_bytes,
                "miss_bytes": self.miss_bytes, "prefetch_bytes": self.prefetch_bytes, "scan": self.scan,
                "prefetch_scan": self.prefetch_scan, "layers": self.layers,
                "per_layer": {k: [int(x) for x in v] for k, v in self.per_layer.items()}, "seconds": self.seconds}


# ----------------------------------------------------------------------------------------------------------------
# State of one (layer, session): which position each slot holds, and what the policy remembers
# ----------------------------------------------------------------------------------------------------------------
class State:
    """One (layer, session) of a replay. A policy that remembers more subclasses it and overrides
    ``Policy.new_state``."""


    def __init__(self, hot_rows: int, capacity: int):
        self.slot_of_position = np.full(capacity, -1, np.int32)
        self.position_of_slot = np.full(hot_rows, -1, np.int64)
        self.clock = 0
        self.rounds = 0  # rounds of this (layer, session), as the engine counts them
        self.ref = np.zeros(hot_rows, bool)
        self.last_use = np.zeros(hot_rows, np.int64)
        self.freq = np.zeros(hot_rows, np.int64)

    def load(self, position_of_slot: np.ndarray, clock: int, rounds: int = 0, hits=None, last_use=None) -> None:
        """Start from an engine snapshot (``glm53.trace`` segments) of this state's size; LFU's counts when the
        engine kept them."""
        pos = np.asarray(position_of_slot, np.int64)
        self.slot_of_position[:] = -1
        held = np.flatnonzero(pos >= 0)
        self.slot_of_position[pos[held]] = held
        self.position_of_slot[:] = pos
        self.clock, self.rounds = int(clock), int(rounds)
        if hits is not None:
            self.freq[:] = hits
            self.last_use[:] = last_use

    def drop_from(self, bound: int) -> None:
        """Empty the slots holding positions ``>= bound`` (a rollback: ``offload.truncate_slot``). The policy's
        memory of those slots stays, as the engine's does; a fill resets it."""
        gone = np.flatnonzero(self.position_of_slot >= bound)
        if gone.size:
            self.slot_of_position[self.position_of_slot[gone]] = -1
            self.position_of_slot[gone] = -1

    def copy(self) -> "State":
        return copy.deepcopy(self)


def _distinct(slots: np.ndarray, hot_rows: int) -> np.ndarray:
    """The distinct slots of ``slots`` (all in ``[0, hot_rows)``), sorted: a mask over the slots, cheaper than
    np.unique's hashing, which was a third of a sweep's time."""
    seen = np.zeros(hot_rows, bool)
    seen[slots] = True
    return np.flatnonzero(seen)


class Policy:
    """Base: the round mechanics. Subclasses choose victims (``victims``) and may remember hits (``touch``) and
    fills (``filled``); the module docstring gives the contract."""

    name = "base"
    prefetch = 0
    page_rows = 0  # the trace's page size, for prefetch: 0 when the trace has no ring (synthetic)

    def __init__(self, hot_rows: int, capacity: int):
        _check_size(hot_rows)
        self.H, self.N = int(hot_rows), int(capacity)

    def __init_subclass__(cls, **kwargs):
        # A policy written against the private hooks would otherwise be silently the base's (or fail on its first
        # fill with "define victims()")
        super().__init_subclass__(**kwargs)
        old = [n for n in ("_victims", "_touch", "_filled", "_key") if n in vars(cls)]
        if old:
            raise TypeError(f"policy class {cls.__name__}: the hooks are public now: rename {', '.join(old)} to "
                            f"{', '.join(n[1:] for n in old)}")

    def new_state(self) -> State:
        return State(self.H, self.N)

    # ---- hooks ----
    def victims(self, st: State, n: int, pinned: np.ndarray, t: int, start: int, window: int) -> tuple:
        """Up to ``n`` victim slots (an array: distinct, unpinned, in ``[0, H)``) and the slots examined."""
        raise NotImplementedError(f"policy {self.name!r}: define victims()")

    def touch(self, st: State, slots: np.ndarray, t: int) -> None:
        """Slots hit this round (valid entries, each slot once)."""

    def filled(self, st: State, slots: np.ndarray, t: int) -> None:
        """Slots just filled."""

    # ---- a round ----
    def round(self, st: State, pos: np.ndarray, valid: np.ndarray, in_ring: np.ndarray, start: int, step: int,
              counts: np.ndarray, scans: list, prefetch_scans: list | None = None) -> None:
        """One round of one (layer, session) at trace step ``step``; adds to ``counts`` (``COUNTS`` order) and
        appends the demand fill's search length to ``scans``, a prefetch fill's to ``prefetch_scans``. Policies
        stamp uses with the state's own round (``t``), as the engine does."""
        H, N = self.H, self.N
        t = st.rounds + 1
        # Valid host lookups are in [0, N) (SelectionTrace checks them); only invalid and ring entries, whose rows
        # the fill never reads, may hold anything, and are clipped just to index the map (their hits still pin,
        # as in the engine).
        p = np.clip(pos, 0, N - 1)
        slot = st.slot_of_position[p]
        hit = ~in_ring & (slot >= 0)
        miss = ~in_ring & (slot < 0)
        counts[0] += np.count_nonzero(hit & valid)
        counts[1] += np.count_nonzero(miss & valid)
        counts[2] += np.count_nonzero(in_ring & valid)
        pinned = np.zeros(H, bool)
        pinned[slot[hit]] = True
        touched = _distinct(slot[hit & valid], H)
        if touched.size:
            self.touch(st, touched, t)
        wanted = np.flatnonzero(miss & valid)
        if wanted.size:
            # each missed position once, at its first valid entry, in entry order
            _, first = np.unique(p[wanted], return_index=True)
            new = p[wanted[np.sort(first)]]
            self._fill(st, new, pinned, min(pos.size, H), t, start, counts, scans, window=pos.size)
        if self.prefetch and wanted.size:
            self._prefetch(st, p[wanted], pinned, in_ring, pos, start, t, counts,
                           prefetch_scans if prefetch_scans is not None else [])
        st.rounds = t

    def _fill(self, st, new, pinned, F, t, start, counts, scans, window, prefetch=False):
        n = min(new.size, F)
        victims, scanned = self.victims(st, n, pinned, t, start, window)
        victims = self._checked(np.asarray(victims), n, pinned)
        k = victims.size
        if not k:
            return 0
        new = new[:k]
        old = st.position_of_slot[victims]
        gone = old[old >= 0]
        st.slot_of_position[gone] = -1
        counts[4] += gone.size
        st.slot_of_position[new] = victims
        st.position_of_slot[victims] = new
        counts[5 if prefetch else 3] += k
        pinned[victims] = True  # a row just brought in is not a victim again in the same round
        self.filled(st, victims, t)
        scans.append(int(scanned))
        return k

    def _checked(self, victims: np.ndarray, n: int, pinned: np.ndarray) -> np.ndarray:
        """``victims`` as the contract has them (at most ``n`` distinct unpinned slots in ``[0, H)``), or a
        ValueError naming the policy: a slot given twice would hold two positions, a pinned one would evict a row
        this round reads."""
        if victims.ndim != 1 or (victims.size and not np.issubdtype(victims.dtype, np.integer)):
            raise ValueError(f"policy {self.name!r}: victims() must return a 1-d array of slot numbers, got "
                             f"{victims.dtype} of shape {victims.shape}")
        v = victims.astype(np.int64)
        problem = None
        if v.size > n:
            problem = f"{v.size} slots for {n} misses"
        elif v.size and (v.min() < 0 or v.max() >= self.H):
            problem = f"slot {int(v[(v < 0) | (v >= self.H)][0])} outside [0, {self.H})"
        elif _distinct(v, self.H).size != v.size:
            problem = "a slot more than once"
        elif pinned[v].any():
            problem = f"slot {int(v[pinned[v]][0])}, pinned this round (hit or just filled)"
        if problem:
            raise ValueError(f"policy {self.name!r}: victims() returned {problem}; it must return at most n distinct "
                             f"unpinned slots in [0, hot_rows)")
        return v

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

    def victims(self, st, n, pinned, t, start, window):
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

    def touch(self, st, slots, t):
        st.ref[slots] = True

    def filled(self, st, slots, t):
        st.ref[slots] = True

    def victims(self, st, n, pinned, t, start, window):
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


class Ranked(Policy):
    """Victims: the unpinned slots with the smallest ``key`` (empty slots first, ties to the lower slot)."""

    def key(self, st, t, start, window) -> np.ndarray:
        """Rank of each slot this round (``t``), ``[H]`` ints: smallest evicted first (read for occupied slots)."""
        raise NotImplementedError(f"policy {self.name!r}: define key()")

    def touch(self, st, slots, t):
        st.last_use[slots] = t
        st.freq[slots] += 1

    def filled(self, st, slots, t):
        st.last_use[slots] = t
        st.freq[slots] = 0

    def victims(self, st, n, pinned, t, start, window):
        H = self.H
        n = min(n, int(np.count_nonzero(~pinned)))
        if n <= 0:
            return np.zeros(0, np.int64), 0
        key = np.asarray(self.key(st, t, start, window))
        if key.shape != (H,) or not np.issubdtype(key.dtype, np.integer):
            raise ValueError(f"policy {self.name!r}: key() must return one int per slot ([{H}]), got {key.dtype} "
                             f"of shape {key.shape}")
        key = key.astype(np.int64)
        occupied = st.position_of_slot >= 0
        held = key[occupied]
        if held.size and (held.min() < 0 or held.max() >= (1 << 62) // H - 1):
            # (key + 1) * H + slot would leave int64: rank (occupied, key, slot) lexicographically instead
            cand = np.flatnonzero(~pinned)
            by = np.lexsort((cand, np.where(occupied[cand], key[cand], 0), occupied[cand]))
            return cand[by[:n]], H
        # by key, ties to the lower slot (the engine's stable sort): one exact int64 order, partitioned then sorted
        order = np.where(occupied, key + 1, 0) * H + np.arange(H)
        order[pinned] = np.iinfo(np.int64).max
        part = np.argpartition(order, n - 1)[:n] if n < order.size else np.arange(order.size)
        return part[np.argsort(order[part])], H  # a ranked choice looks at every slot


class LRU(Ranked):
    name = "lru"

    def key(self, st, t, start, window):
        return st.last_use


class LFU(Ranked):
    """The engine's LFU (``CacheConfig.policy="lfu"``, ``glm53.offload``): hits since the fill capped at 1,023,
    then age in rounds capped at 2**21 - 1 (older first), then the lower slot."""

    name = "lfu"

    def key(self, st, t, start, window):
        hits = np.minimum(st.freq, LFU_MAX_HITS)
        age = np.clip(t - st.last_use, 0, LFU_MAX_AGE)
        return (hits << 21) | (LFU_MAX_AGE - age)


class WindowSticky(Ranked):
    def __init__(self, hot_rows, capacity, window: int):
        super().__init__(hot_rows, capacity)
        self.window = int(window)
        self.name = f"window{self.window}+sticky"

    def key(self, st, t, start, window):
        recent = (st.position_of_slot >= start - self.window).astype(np.int64)
        return (recent << 39) | (np.minimum(st.freq, (1 << 16) - 1) << 23) | np.minimum(st.last_use, (1 << 23) - 1)


_BASE = {"circular": Circular, "clock": Clock, "lru": LRU, "lfu": LFU}
_BUILTIN = re.compile(r"circular|clock|lru|lfu|window(\d+)\+sticky")
_REGISTERED: dict[str, Callable[[int, int], Policy]] = {}


def register(name: str, factory: Callable[[int, int], Policy], *, replace: bool = False) -> None:
    """Make ``name`` a policy spec: ``factory(hot_rows, capacity)`` returns a ``Policy`` (the module docstring
    gives the hooks' contract). ``replace``: redefine a name registered before (a notebook cell run twice)."""
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.:-]*", name or "") or _BUILTIN.fullmatch(name):
        raise ValueError(f"register: {name!r} is not a name for a new policy (letters, digits, _ . : -, not a "
                         f"built-in's: {POLICIES})")
    if not callable(factory):
        raise ValueError(f"register: the factory of {name!r} must be callable as factory(hot_rows, capacity)")
    if name in _REGISTERED and not replace:
        raise ValueError(f"register: {name!r} is registered already (replace=True redefines it)")
    _REGISTERED[name] = factory


def registered() -> list[str]:
    return sorted(_REGISTERED)


def _parse(spec: str) -> tuple[str, int]:
    """``(base, prefetch)`` of a spec, or a ValueError naming the choices."""
    m = re.fullmatch(r"(.+?)(\+prefetch(\d+))?", spec if isinstance(spec, str) else "")
    if not m or not (_BUILTIN.fullmatch(m.group(1)) or m.group(1) in _REGISTERED):
        extra = f"; registered: {', '.join(registered())}" if _REGISTERED else ""
        raise ValueError(f"unknown policy {spec!r}; choose from {POLICIES}{extra}")
    return m.group(1), int(m.group(3) or 0)


def check_spec(spec: str) -> None:
    """A ValueError naming the choices unless ``spec`` names a policy (``POLICIES``, registered ones included);
    nothing is built."""
    _parse(spec)


def make(spec: str, hot_rows: int, capacity: int) -> Policy:
    """A policy from its name (``POLICIES``)."""
    base, prefetch = _parse(spec)
    _check_size(hot_rows)
    if base in _REGISTERED:
        pol = _REGISTERED[base](hot_rows, capacity)
        if not isinstance(pol, Policy):
            raise ValueError(f"policy {base!r}: its factory returned {type(pol).__name__}, not a policies.Policy")
        if (pol.H, pol.N) != (hot_rows, capacity):
            raise ValueError(f"policy {base!r}: its factory made {pol.H} slots over {pol.N} positions when asked "
                             f"for {hot_rows} over {capacity}")
        pol.name = base
    else:
        window = _BUILTIN.fullmatch(base).group(1)
        pol = WindowSticky(hot_rows, capacity, int(window)) if window else _BASE[base](hot_rows, capacity)
    if prefetch:
        pol.prefetch = prefetch
        pol.name = f"{pol.name}+prefetch{prefetch}"
    return pol


def _check_size(hot_rows) -> None:
    if isinstance(hot_rows, bool) or not isinstance(hot_rows, (int, np.integer)):
        raise ValueError(f"hot_rows must be an int, got {hot_rows!r}")
    if hot_rows < 1:
        raise ValueError(f"hot_rows must be >= 1, got {hot_rows}")


def check_hot_rows(trace, hot_rows) -> None:
    """A hot-cache size a replay of ``trace`` studies: ``1 <= hot_rows <= capacity`` (a larger cache than the rows
    a session can have holds every position either way), or the recording engine's own size (the engine rounds its
    hot cache up to a power of two, which may pass the capacity)."""
    _check_size(hot_rows)
    N, own = int(trace.meta["capacity"]), trace.meta.get("hot_rows")
    if hot_rows > N and hot_rows != own:
        also = f" or the recording engine's own {own}" if own else ""
        raise ValueError(f"hot_rows={hot_rows} exceeds the trace's capacity ({N} rows per session, "
                         f"{trace.meta.get('source', 'trace')}): every position fits in {N} slots; replay sizes up "
                         f"to {N}{also}")


def replay(trace, policy: "str | Policy" = "circular", hot_rows: int | None = None, *,
           from_snapshots: bool = False) -> ReplayResult:
    """Replay ``trace`` (a ``glm53.trace.SelectionTrace``) through ``policy``, a name (``POLICIES``, registered ones
    included) with ``hot_rows`` slots per (layer, session) (default: the recording engine's), or a ``Policy``
    instance (its own size; ``hot_rows`` None or the same). Cold, every state starts empty and each segment's start
    applies what the engine did between generate calls (rollback, fork: the module docstring); with
    ``from_snapshots`` (the engine's policy at the engine's size only) each segment starts from the engine's own hot
    cache: then the counts equal the engine's own, and so do a cold replay's of the engine's policy."""
    t0 = time.perf_counter()
    meta = trace.meta
    N = int(meta["capacity"])
    if isinstance(policy, Policy):
        if hot_rows is not None and hot_rows != policy.H:
            raise ValueError(f"replay: the policy {policy.name!r} has {policy.H} slots, hot_rows={hot_rows} asks "
                             "for another size")
        if policy.N < N:
            raise ValueError(f"replay: the policy {policy.name!r} maps {policy.N} positions, the trace's history "
                             f"has {N}")
        check_hot_rows(trace, policy.H)
        pol = copy.copy(policy)  # page_rows below is this trace's
    else:
        H = hot_rows if hot_rows is not None else meta.get("hot_rows")
        if H is None:
            raise ValueError("replay: give hot_rows (this trace records no engine hot-cache size)")
        check_hot_rows(trace, H)
        pol = make(policy, H, N)
    H = pol.H
    pol.page_rows = int(meta.get("page_rows") or 0)
    engine_policy = meta.get("policy", "circular")  # traces recorded before LFU were all circular
    if from_snapshots:
        if not trace.segments:
            raise ValueError(f"replay: from_snapshots needs the hot-cache snapshots an engine recorded; this trace "
                             f"({meta.get('source', 'unknown source')}) has none: replay it cold")
        if pol.name != engine_policy:
            raise ValueError(f"replay: from_snapshots needs the recording engine's policy ({engine_policy!r}), "
                             f"not {pol.name!r}")
        if meta.get("hot_rows") != H:
            raise ValueError(f"replay: the snapshots hold {meta.get('hot_rows')} slots, not {H}")
    layers = sorted(set(trace.layer.tolist()))
    col = {l: i for i, l in enumerate(layers)}
    counts = np.zeros((len(layers), len(COUNTS)), np.int64)
    scans, prefetch_scans = [], []
    states: dict = {}
    at_step: dict = {}
    for seg in trace.segments:
        at_step.setdefault(seg["first_step"], []).append(seg)
    step, layer, session, start = trace.step, trace.layer, trace.session, trace.start
    offset, count = trace.offset, trace.count
    last_step = -1
    for i in range(trace.num_records):
        s = int(step[i])
        if s != last_step:
            for first in [f for f in at_step if last_step < f <= s]:
                for seg in at_step[first]:
                    if from_snapshots:
                        _load_segment(states, seg, pol, layers)
                    else:
                        _carry_over(states, seg, pol, layers, trace, engine_policy)
            last_step = s
        key = (int(layer[i]), int(session[i]))
        st = states.get(key)
        if st is None:
            st = states[key] = pol.new_state()
        a, n = int(offset[i]), int(count[i])
        pol.round(st, trace.positions[a:a + n], trace.valid[a:a + n], trace.in_ring[a:a + n], int(start[i]), s,
                  counts[col[key[0]]], scans, prefetch_scans)
    return ReplayResult(policy=pol.name, hot_rows=H, layers=layers,
                        per_layer={n: counts[:, j].tolist() for j, n in enumerate(COUNTS)},
                        scan=_scan_summary(scans), prefetch_scan=_scan_summary(prefetch_scans),
                        row_bytes=int(meta.get("row_bytes") or 656), seconds=time.perf_counter() - t0)


def _load_segment(states: dict, seg: dict, pol: Policy, layers: list) -> None:
    snap = seg["snapshot"]
    lfu = "policy_hits" in snap
    for j, sess in enumerate(seg["sessions"]):
        for l in layers:
            st = states.get((l, sess))
            if st is None:
                st = states[(l, sess)] = pol.new_state()
            st.load(snap["position_of_slot"][j][l], int(snap["clock"][j][l]), int(snap["rounds"][j][l]),
                    snap["policy_hits"][j][l] if lfu else None, snap["policy_last_use"][j][l] if lfu else None)


def _carry_over(states: dict, seg: dict, pol: Policy, layers: list, trace, engine_policy: str) -> None:
    """What the engine did to the hot caches of this segment's sessions since the last generate call, applied to
    the replayed policy's states (the module docstring's *Between generate calls*)."""
    snap = seg["snapshot"]
    sessions = seg["sessions"]
    parents = seg.get("parents")
    host_len = seg.get("host_len")
    if host_len is None:
        host_len = [_inferred_host_len(trace, seg, sess) for sess in sessions]
    own_memory = pol.name == engine_policy and pol.H == snap["position_of_slot"].shape[-1] and \
        "policy_hits" in snap
    started = {}
    for j, sess in enumerate(sessions):
        if (layers[0], sess) in states:
            continue
        parent = int(parents[j]) if parents is not None else -1
        for l in layers:
            src = states.get((l, parent)) if parent >= 0 else None
            if src is not None:  # a fork: the copy of what the parent's replay holds now
                started[(l, sess)] = src.copy()
                continue
            st = started[(l, sess)] = pol.new_state()
            pos = np.asarray(snap["position_of_slot"][j][l], np.int64)
            clock, rounds = int(snap["clock"][j][l]), int(snap["rounds"][j][l])
            if pos.size == pol.H:
                st.load(pos, clock, rounds, snap["policy_hits"][j][l] if own_memory else None,
                        snap["policy_last_use"][j][l] if own_memory else None)
            else:  # another size: the positions it held, in slot order, as many as fit
                held = pos[pos >= 0][:pol.H]
                seeded = np.full(pol.H, -1, np.int64)
                seeded[:held.size] = held
                st.load(seeded, 0, rounds)
    states.update(started)  # forks copy their parents before any rollback below cuts them
    for j, sess in enumerate(sessions):
        if host_len[j] is None:
            continue
        for l in layers:
            st = states.get((l, sess))
            if st is not None:
                st.drop_from(int(host_len[j]))


def _inferred_host_len(trace, seg: dict, sess: int) -> int | None:
    """For traces saved before ``host_len`` was recorded: the session's first step in the segment starts at its
    history length ``c``; after a rollback host memory holds ``c`` rounded down to a page (``truncate_slot``), and
    without one at most that, so cutting there is exact when the first step has a round. None: no round, or no
    pages (nothing to infer)."""
    page = int(trace.meta.get("page_rows") or 0)
    mine = np.flatnonzero((trace.step >= seg["first_step"]) & (trace.step < seg["end_step"])
                          & (trace.session == sess))
    if not page or not mine.size:
        return None
    return int(trace.start[mine[0]]) // page * page


def segment_counts(trace) -> np.ndarray:
    """The engine's own counters over the recorded segments, ``[layers, 5]`` (``COUNTS[:5]``), in the trace's layer
    order: what ``replay(..., from_snapshots=True)`` (and a cold replay of the engine's policy) must reproduce."""
    layers = sorted(set(trace.layer.tolist()))
    out = np.zeros((len(layers), 5), np.int64)
    for seg in trace.segments:
        delta = np.asarray(seg["counters_after"], np.int64) - np.asarray(seg["counters_before"], np.int64)
        out += delta.sum(0)[layers]
    return out


def sweep(trace, specs, hot_rows_list, *, progress: bool | None = None) -> list[ReplayResult]:
    """Every policy in ``specs`` at every size in ``hot_rows_list``, cold. A spec is a name (``POLICIES``,
    registered ones included) or a ``Policy`` instance, which is one size: replayed once, at its own. Every name and
    size is checked before any replay. ``progress``: a bar over the replays (True: at once; None: once they have
    run 2 s; False: none)."""
    from glm53 import progress as progress_lib

    for h in hot_rows_list:
        check_hot_rows(trace, h)
    jobs = []
    for s in specs:
        if isinstance(s, Policy):
            check_hot_rows(trace, s.H)
            jobs.append((s, None))
        else:
            _parse(s)
            jobs += [(s, h) for h in hot_rows_list]
    return [replay(trace, s, h) for s, h in progress_lib.bar(jobs, progress=progress, desc="policies", leave=False)]
