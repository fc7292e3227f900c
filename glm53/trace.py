"""Selection traces: every position the DSA selection of a run looked up in the offload cache, per step, layer and
session, kept so cache policies can be replayed offline without a GPU (``glm53.policies``).

Record one by passing a ``TraceRecorder`` to ``Engine.generate(..., trace=recorder)`` (an offload engine: the
selection is the same in both modes, bit for bit, and only the offload steps classify what they read). The steps
then also return, per layer, the round the hot cache's fill takes (``glm53.offload.trace_rounds``): the looked-up
positions in entry order, which were valid, which the ring served. Without a recorder the steps are the same
programs as before (``trace`` is a static argument), so recording costs nothing when off; when on, each step's
rounds come to the host one step late, as the tokens do.

A trace holds, for each generate call (a *segment*), the state of the engine's hot cache for each session at its
start (``position_of_slot``, ``pin_round``, ``rounds``, ``clock``) and the engine's counters at its start and end: a
replay of the engine's own policy from that state must reproduce those counters exactly (``tests/test_policies.py``).
What happened to the hot caches between two calls is kept too, so a cold replay of any policy can apply it to that
policy's own state (``glm53.policies.replay``): each session's ``host_len`` at the segment's start (a rollback empties
the hot slots at positions from there on, ``offload.truncate_slot``) and its ``parent``, for a session first seen in
this segment whose hot cache is a copy of one recorded before (a fork, ``offload.copy_slot``). The recorder finds
the parent by comparing the new session's hot-cache state with the state every recorded session ended its last
segment in (cut at the new session's ``host_len``, in case the parent was rolled back before the fork): a copy is
equal to it in every layer's slot map, round count and clock. Traces saved before these were kept still load;
their replays infer ``host_len`` from each session's first step in the segment and start new sessions from the
snapshot.

Each record is one (step, layer, session) round of ``count`` entries at ``offset`` in the flat ``positions`` /
``valid`` / ``in_ring`` arrays. A valid entry that the ring did not serve names a row of history: its position must
lie in ``[0, meta["capacity"])`` (checked whenever a trace is built or loaded); invalid and ring entries may hold
anything (the fill never reads their rows). Files are ``.npz`` (compressed), with the config, the cache geometry
and the git revision in ``meta``.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from glm53.provenance import git_revision

RECORD_FIELDS = ("step", "layer", "session", "start", "offset", "count")
ENTRY_FIELDS = ("positions", "valid", "in_ring")
SNAPSHOT_FIELDS = ("position_of_slot", "pin_round", "rounds", "clock")
# Kept per segment since rollback and fork between calls are replayed cold; optional, so version-1 files saved
# before them still load (their replays infer what they can: ``glm53.policies.replay``).
SEGMENT_FIELDS_SINCE_V1 = ("host_len", "parents")
# What a fork copies of a session's hot cache and a rollback leaves as it was (apart from emptied slots): how the
# recorder recognises a fork's parent.
_FORK_FIELDS = ("position_of_slot", "rounds", "clock")
FORMAT_VERSION = 1


@dataclasses.dataclass
class SelectionTrace:
    """A recorded (or synthetic) selection trace. Records are sorted by step; within a step by layer, then session.

    ``meta``: ``hot_rows``, ``capacity``, ``num_layers``, ``page_rows``, ``row_bytes``, ``topk``, ``source`` and, for
    recorded traces, ``model`` / ``cache`` configs and ``git``. ``segments``: one dict per generate call with
    ``first_step``, ``end_step`` (exclusive), ``sessions`` (indices into ``sessions``), the hot-cache ``snapshot`` of
    each at the start (``[L, H]`` / ``[L]`` arrays; the policy's own state as ``policy_<name>``),
    ``counters_before`` / ``counters_after`` (``[n, L, 5]``, ``glm53.offload.COUNTERS``) and, in traces recorded
    since they were kept, ``host_len`` (``[n]``: rows of each session in host memory at the start) and ``parents``
    (``[n]``: the session index a new session was forked from, -1 for none); an empty list for synthetic
    traces."""

    meta: dict
    sessions: list
    step: np.ndarray
    layer: np.ndarray
    session: np.ndarray
    start: np.ndarray
    offset: np.ndarray
    count: np.ndarray
    positions: np.ndarray
    valid: np.ndarray
    in_ring: np.ndarray
    segments: list = dataclasses.field(default_factory=list)

    def __post_init__(self):
        n = len(self.step)
        for f in RECORD_FIELDS:
            if len(getattr(self, f)) != n:
                raise ValueError(f"trace: record field {f!r} has {len(getattr(self, f))} entries, step has {n}")
        E = len(self.positions)
        if len(self.valid) != E or len(self.in_ring) != E:
            raise ValueError("trace: positions, valid and in_ring differ in length")
        if n and (int((self.offset + self.count).max()) > E or int(self.offset.min()) < 0):
            raise ValueError("trace: a record points outside the entry arrays")
        if n and (np.diff(self.step) < 0).any():
            raise ValueError("trace: records are not sorted by step")
        self._check_positions()

    def _check_positions(self) -> None:
        """Every valid entry the ring did not serve names a row of history, in ``[0, capacity)``: a replay looks it
        up in a map of ``capacity`` positions, and an out-of-range one would alias another row (and hit)."""
        capacity = self.meta.get("capacity")
        if capacity is None:
            raise ValueError("trace: meta has no 'capacity' (the rows of history a session's positions index)")
        looked = self.valid & ~self.in_ring
        bad = looked & ((self.positions < 0) | (self.positions >= int(capacity)))
        if not bad.any():
            return
        e = int(np.argmax(bad))
        holders = np.flatnonzero((self.offset <= e) & (e < self.offset + self.count))
        if not holders.size:
            raise ValueError(f"trace: entry {e} looks up position {int(self.positions[e])}, outside the history "
                             f"[0, {capacity}) (meta['capacity'])")
        i = int(holders[0])
        raise ValueError(f"trace: record {i} (step {int(self.step[i])}, layer {int(self.layer[i])}, session "
                         f"{int(self.session[i])}) looks up position {int(self.positions[e])}, outside the history "
                         f"[0, {capacity}) (meta['capacity']); {int(bad.sum())} such entries in all")

    # ---- views ----
    @property
    def num_steps(self) -> int:
        return int(self.step.max()) + 1 if len(self.step) else 0

    @property
    def num_records(self) -> int:
        return len(self.step)

    def entries(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(positions, valid, in_ring)`` of record ``i``."""
        a, n = int(self.offset[i]), int(self.count[i])
        return self.positions[a:a + n], self.valid[a:a + n], self.in_ring[a:a + n]

    def summary(self) -> dict:
        looked = self.valid & ~self.in_ring
        return {"steps": self.num_steps, "records": self.num_records, "sessions": len(self.sessions),
                "layers": sorted(set(self.layer.tolist())), "entries": len(self.positions),
                "valid_lookups": int(looked.sum()), "ring_reads": int((self.valid & self.in_ring).sum()),
                "distinct_positions": int(np.unique(self.positions[looked]).size) if looked.any() else 0,
                "segments": len(self.segments), **{k: self.meta.get(k) for k in ("hot_rows", "capacity", "source")}}

    # ---- files ----
    def save(self, path: str) -> str:
        arrays = {f: getattr(self, f) for f in RECORD_FIELDS + ENTRY_FIELDS}
        arrays["sessions"] = np.asarray(self.sessions, np.int64)
        for k, seg in enumerate(self.segments):
            arrays[f"seg{k}_sessions"] = np.asarray(seg["sessions"], np.int64)
            arrays[f"seg{k}_steps"] = np.asarray([seg["first_step"], seg["end_step"]], np.int64)
            for name in ("counters_before", "counters_after") + SEGMENT_FIELDS_SINCE_V1:
                if name in seg:  # host_len and parents: absent from traces recorded before they were kept
                    arrays[f"seg{k}_{name}"] = np.asarray(seg[name])
            for name, a in seg["snapshot"].items():  # SNAPSHOT_FIELDS and the policy's own state
                arrays[f"seg{k}_snap_{name}"] = np.asarray(a)
        meta = {**self.meta, "format_version": FORMAT_VERSION, "num_segments": len(self.segments)}
        arrays["meta"] = np.asarray(json.dumps(meta, default=str))
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "wb") as f:  # a file object: np.savez would append ".npz" to a path without it
            np.savez_compressed(f, **arrays)
        return path

    @classmethod
    def load(cls, path: str) -> "SelectionTrace":
        try:
            z = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise ValueError(f"{path}: not a selection trace (.npz): {e}") from e
        with z:
            missing = [f for f in RECORD_FIELDS + ENTRY_FIELDS + ("meta", "sessions") if f not in z.files]
            if missing:
                raise ValueError(f"{path}: not a selection trace: missing {missing}")
            meta = json.loads(str(z["meta"]))
            if meta.get("format_version") != FORMAT_VERSION:
                raise ValueError(f"{path}: trace format {meta.get('format_version')}, this glm53 reads "
                                 f"{FORMAT_VERSION}")
            segments = []
            for k in range(int(meta.get("num_segments", 0))):
                first, end = z[f"seg{k}_steps"].tolist()
                segments.append({"first_step": first, "end_step": end,
                                 "sessions": z[f"seg{k}_sessions"].tolist(),
                                 "counters_before": z[f"seg{k}_counters_before"],
                                 "counters_after": z[f"seg{k}_counters_after"],
                                 "snapshot": {f[len(f"seg{k}_snap_"):]: z[f] for f in z.files
                                              if f.startswith(f"seg{k}_snap_")},
                                 **{name: z[f"seg{k}_{name}"] for name in SEGMENT_FIELDS_SINCE_V1
                                    if f"seg{k}_{name}" in z.files}})
            return cls(meta=meta, sessions=z["sessions"].tolist(), segments=segments,
                       **{f: z[f] for f in RECORD_FIELDS + ENTRY_FIELDS})

    @classmethod
    def from_rounds(cls, rounds, *, meta: dict, sessions: list | None = None) -> "SelectionTrace":
        """A trace from ``rounds``: an iterable of ``(step, layer, session, start, positions)`` (valid lookups of
        host rows, no ring): synthetic workloads and other sources of selections. ``meta`` must give ``capacity``:
        every position lies in ``[0, capacity)``."""
        if meta.get("capacity") is None:
            raise ValueError("trace: from_rounds needs meta['capacity'] (the rows of history the positions index)")
        cols = {f: [] for f in RECORD_FIELDS}
        pos, n_sessions = [], 0
        offset = 0
        for step, layer, session, start, p in rounds:
            p = np.asarray(p, np.int32).reshape(-1)
            for f, v in zip(RECORD_FIELDS, (step, layer, session, start, offset, p.size)):
                cols[f].append(v)
            pos.append(p)
            offset += p.size
            n_sessions = max(n_sessions, session + 1)
        positions = np.concatenate(pos) if pos else np.zeros(0, np.int32)
        base = {"hot_rows": None, "page_rows": None, "row_bytes": 656, "num_layers": None}
        return cls(meta={**base, **meta}, sessions=list(sessions) if sessions is not None else list(range(n_sessions)),
                   positions=positions, valid=np.ones(positions.size, bool), in_ring=np.zeros(positions.size, bool),
                   **_record_arrays(cols))


def _record_arrays(cols: dict) -> dict:
    dtypes = {"step": np.int32, "layer": np.int16, "session": np.int32, "start": np.int64, "offset": np.int64,
              "count": np.int32}
    return {f: np.asarray(cols[f], dtypes[f]) for f in RECORD_FIELDS}


class TraceRecorder:
    """Collects a trace across ``Engine.generate(..., trace=recorder)`` calls of one engine; ``trace()`` /
    ``save(path)`` when done. Steps are numbered across the calls in the order they ran."""

    def __init__(self):
        self.meta: dict | None = None
        self._engine_id = None
        self._sids: list = []
        self._index: dict = {}
        self._cols = {f: [] for f in RECORD_FIELDS}
        self._entries = {f: [] for f in ENTRY_FIELDS}
        self._offset = 0
        self._steps = 0
        self.segments: list = []
        self._open = None
        self._last_state: dict = {}  # session index -> its hot cache (_FORK_FIELDS) at the end of its last segment

    # ---- called by the engine ----
    def begin(self, engine, sessions: list) -> None:
        if not engine.offload:
            raise ValueError("trace: record with an offload engine (cache mode 'offload'): the selections are the "
                             "same as resident, and only the offload steps classify what they read")
        if self._engine_id is None:
            cc = engine.cache_config
            self._engine_id = id(engine)
            self.meta = {"source": "engine", "policy": cc.policy, "hot_rows": cc.hot_rows,
                         "capacity": engine.capacity,
                         "num_layers": engine.cache.num_layers, "page_rows": engine.page_rows,
                         "row_bytes": engine.cache.fmt.bytes_per_row, "topk": engine.topk,
                         "model": dataclasses.asdict(engine.cfg), "cache": dataclasses.asdict(cc),
                         "git": git_revision()}
        elif self._engine_id != id(engine):
            raise ValueError("trace: a recorder follows one engine (its sessions, slots and hot caches)")
        new = [s.sid not in self._index for s in sessions]
        idx = [self._session_index(s.sid) for s in sessions]
        slots = np.asarray([s.slot for s in sessions])
        c = engine.cache
        snap = {n: np.asarray(getattr(c, n))[:, slots].swapaxes(0, 1) for n in SNAPSHOT_FIELDS}  # [n, L, ...]
        snap.update({f"policy_{n}": np.asarray(a)[:, slots].swapaxes(0, 1) for n, a in c.policy_state.items()})
        host_len = np.asarray(c.host_len)[slots].astype(np.int64)
        parents = np.asarray([self._parent(snap, j, int(host_len[j])) if is_new else -1
                              for j, is_new in enumerate(new)], np.int64)
        self._open = {"first_step": self._steps, "sessions": idx, "snapshot": snap,
                      "counters_before": engine.session_counters(sessions), "host_len": host_len,
                      "parents": parents}

    def end(self, engine, sessions: list) -> None:
        if self._open is None:
            return
        seg, self._open = self._open, None
        seg["end_step"] = self._steps
        seg["counters_after"] = engine.session_counters(sessions)
        self.segments.append(seg)
        slots = np.asarray([s.slot for s in sessions])
        state = {n: np.asarray(getattr(engine.cache, n))[:, slots].swapaxes(0, 1) for n in _FORK_FIELDS}
        for j, i in enumerate(seg["sessions"]):
            self._last_state[i] = {n: a[j] for n, a in state.items()}

    def _parent(self, snap: dict, j: int, host_len: int) -> int:
        """The recorded session whose hot cache, as its last segment left it and cut at ``host_len`` as a rollback
        cuts it, session ``j`` of ``snap`` holds a copy of: its fork parent; -1 when it holds nothing (a fresh
        session) or no recorded state matches (its parent ran outside the recorder since)."""
        mine = {n: snap[n][j] for n in _FORK_FIELDS}
        if not (mine["rounds"] > 0).any():
            return -1
        for i, st in self._last_state.items():
            pos = np.where(st["position_of_slot"] >= host_len, -1, st["position_of_slot"])
            if (np.array_equal(pos, mine["position_of_slot"]) and np.array_equal(st["rounds"], mine["rounds"])
                    and np.array_equal(st["clock"], mine["clock"])):
                return int(i)
        return -1

    def add_step(self, rounds: dict, lane_sids: list) -> None:
        """One step's ``trace_rounds`` output (host arrays), lane b running session ``lane_sids[b]`` (padding
        lanes beyond the list, and inactive lanes, are left out: they did nothing)."""
        step = self._steps
        self._steps += 1
        if not rounds:
            return
        layers = np.asarray(rounds["layers"]).tolist()
        pos, valid, in_ring = (np.asarray(rounds[k]) for k in ("pos", "valid", "in_ring"))
        active, start = np.asarray(rounds["active"]), np.asarray(rounds["start"])
        M = pos.shape[2]
        for i, layer in enumerate(layers):
            for b, sid in enumerate(lane_sids):
                if not active[b]:
                    continue
                for f, v in zip(RECORD_FIELDS, (step, layer, self._session_index(sid), int(start[b]), self._offset,
                                                M)):
                    self._cols[f].append(v)
                self._entries["positions"].append(pos[i, b].astype(np.int32))
                self._entries["valid"].append(valid[i, b].astype(bool))
                self._entries["in_ring"].append(in_ring[i, b].astype(bool))
                self._offset += M

    def _session_index(self, sid: int) -> int:
        if sid not in self._index:
            self._index[sid] = len(self._sids)
            self._sids.append(sid)
        return self._index[sid]

    # ---- results ----
    def trace(self) -> SelectionTrace:
        if self.meta is None:
            raise ValueError("trace: nothing recorded (pass the recorder to Engine.generate(..., trace=...))")
        entries = {f: (np.concatenate(v) if v else np.zeros(0, np.int32 if f == "positions" else bool))
                   for f, v in self._entries.items()}
        return SelectionTrace(meta=dict(self.meta), sessions=list(self._sids), segments=list(self.segments),
                              **_record_arrays(self._cols), **entries)

    def save(self, path: str) -> str:
        return self.trace().save(path)
