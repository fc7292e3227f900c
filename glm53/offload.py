"""Offload mode: the MLA history in host memory (``pinned_host``), a bounded hot cache on the accelerator.

This is the article's final design ("let the GPU manage the hot cache directly") as data plus pure functions:

* **Host history: a paged pool.** Every session's rows live in pages of ``copyback_every`` rows; a page holds that
  span of rows for *all* cache layers, contiguously (flat planes ``[pages * L * P, W]``, row of (page, layer, r) at
  ``(page * L + layer) * P + r``). So one copyback of new rows for all layers is one contiguous write per plane —
  the article's lesson is that the number of host writes, not their size, is the cost (h200-probe: ~0.6 ms per
  write regardless of size). A session's history is never contiguous and never copied when it grows: growth takes
  pages from a free list between steps (``Driver``), and the pool is allocated once from the host budget, so
  admission control can count real allocation. Per-session arrays with a capacity were rejected: growing one means
  copying the whole history, and sessions of different lengths would waste the pool.
* **Device state** (``OffloadState``, per layer and session): ``hot`` slots, ``slot_of_position`` and its inverse
  ``position_of_slot``, pins (``pin_round``: slots the latest round read as hits), the circular ``clock``, the recent
  ``ring`` of rows not yet in host memory, and counters.
* **One round per layer** (``gather_rows``, inside the jitted step, no host round trip): classify each selected
  position — ``p >= host_len``: ring; ``slot_of_position[p] >= 0``: hit; else miss — then one Pallas kernel
  (``kernels_pallas.hot_gather``) reads ring and hot rows from device memory and misses straight from host memory,
  and returns them dequantised for attention and packed for the fill; the round's unique misses are installed into
  victim slots for *later* rounds (decode: ``finish_round``, batched over the layers at the end of the step;
  prefill chunks: right after each layer's gather). The fill's bookkeeping (pins, victims, slot maps, clock,
  counters) is ``kernels_pallas.fill_round``, one Pallas program per layer and session for decode rounds (in XLA it
  was ~15 small kernels a step); its rows are copied by ``kernels_pallas.fill_rows``, which touches only the rows
  really filled. Visibility comes from data dependence: fills happen after the gather, so
  slots filled this round are hit sources only next round, and duplicate misses of one round each read host
  memory. Victims are the first unpinned slots from ``clock`` onward in circular order, found with one cumsum
  over a window of slots (no pathological scan like the article's clock with reference bits). Prefill chunks are
  rounds too, so the same rule warms the hot cache during prefill: at its end the slots hold the rows the last
  chunks' queries selected from host memory, the ones decode is most likely to select next.
* **Batched copyback** (``Driver.after_step`` -> ``_copyback``): whenever a session has ``copyback_every`` rows in
  the ring, those rows of all layers go to its next host page in one write per plane, in place (donated). It is
  its own small jitted call between steps, which only read the history. The two alternatives measured worse or no
  better on the H200 (``experiments.bench_copyback``): threading the history through every step (donated and
  returned) changed nothing, and making the copyback a static variant of the step cost ~49 ms per copyback.

Resident and offload read the same packed bytes for every position (rows are packed once, when written), so their
logits and tokens are bit-identical; the tests check it.

On the CPU backend XLA cannot gather from ``pinned_host`` operands, so the reference path there copies the host
planes to the device inside the step (both are host RAM on a CPU; the GPU path reads them zero-copy).
"""

from __future__ import annotations

import collections
import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import kv_formats
from glm53.config import CacheConfig, ConfigError, ModelConfig

COUNTERS = ("hits", "misses", "ring_reads", "fills", "evictions")
Array = jax.Array


@flax.struct.dataclass
class OffloadState:
    page_table: Array  # int32[B, pages_per_session]: logical page -> pool page (-1 = not in host memory yet)
    host_len: Array  # int32[B]: rows [0, host_len) are in host memory; [host_len, length) only in the ring
    ring: dict  # plane -> [L, B, R, W] device: row of position p at p % R
    hot: dict  # plane -> [L, B, H, W] device
    slot_of_position: Array  # int32[L, B, N]: hot slot holding position p (-1 = not hot)
    position_of_slot: Array  # int32[L, B, H]: position held by a slot (-1 = empty)
    # Pins as round stamps: a slot is pinned by a round when it was read there as a hit (never that round's victim).
    # Stamping the round's hit slots in place replaces clearing and re-setting a whole [H] mask every round.
    pin_round: Array  # int32[L, B, H]: the round in which a slot was last read as a hit (-1 never)
    rounds: Array  # int32[L, B]: rounds completed (decode steps, prefill chunks) per layer and session
    clock: Array  # int32[L, B]: where the next victim search starts
    counters: Array  # int32[L, B, len(COUNTERS)]
    copybacks: Array  # int32[B]: pages written to host memory
    # Inside a step only: each layer's round awaiting its fill (``finish_round``); always None between steps.
    pending: Any = None
    page_rows: int = flax.struct.field(pytree_node=False, default=64)

    @property
    def ring_rows(self) -> int:
        return int(next(iter(self.ring.values())).shape[2])

    @property
    def hot_rows(self) -> int:
        return int(self.position_of_slot.shape[2])

    @property
    def pinned(self) -> Array:
        """bool[L, B, H]: the slots the latest round read as hits."""
        return self.pin_round == self.rounds[..., None]

    def nbytes(self) -> dict[str, int]:
        return {"hot": sum(int(a.nbytes) for a in self.hot.values()),
                "ring": sum(int(a.nbytes) for a in self.ring.values()),
                "slot_maps": int(self.slot_of_position.nbytes + self.position_of_slot.nbytes
                                  + self.pin_round.nbytes),
                "page_table": int(self.page_table.nbytes)}


def ring_rows_for(cc: CacheConfig) -> int:
    """The ring holds every row not yet in host memory: up to a page minus one, plus one step's new rows (a whole
    prefill chunk at most). A power of two, so ``p % R`` is cheap and pages never wrap inside the ring."""
    need = max(cc.ring_size, cc.prefill_chunk + cc.copyback_every)
    return 1 << (need - 1).bit_length()


def min_hot_rows(cfg: ModelConfig, cc: CacheConfig) -> int:
    """The smallest hot cache that can work: one decode round can pin every selected row (index_topk), and the
    recent ring's rows must be placeable once copied back."""
    return cfg.index_topk + ring_rows_for(cc)


def validate(cfg: ModelConfig, cc: CacheConfig) -> None:
    if cc.page_size != cc.copyback_every:
        raise ConfigError(f"offload: page_rows={cc.page_size} must equal copyback_every={cc.copyback_every} (a "
                          "copyback writes exactly one page)")
    need = min_hot_rows(cfg, cc)
    if cc.hot_rows < need:
        raise ConfigError(f"offload: hot_rows={cc.hot_rows} is below what a round can pin: index_topk="
                          f"{cfg.index_topk} selected rows + {ring_rows_for(cc)} ring rows = {need}")
    if cc.hot_rows & (cc.hot_rows - 1):
        raise ConfigError(f"offload: hot_rows={cc.hot_rows} must be a power of two")


def to_offload(cache, cfg: ModelConfig, cc: CacheConfig):
    """Turn a fresh (empty) resident-layout cache into an offload cache: history -> a ``pinned_host`` page pool of
    ``cc.host_pool_rows`` rows (default: every session's full capacity), allocated once."""
    validate(cfg, cc)
    fmt = kv_formats.get_format(cache.kv_format)
    L, B, N = cache.num_layers, cache.batch, cache.capacity
    P, R, H = cc.copyback_every, ring_rows_for(cc), cc.hot_rows
    pages_per_session = N // P
    host_pages = -(-cc.host_pool_rows // P) if cc.host_pool_rows else B * pages_per_session
    dev = jax.devices()[0]
    host = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    pool = {}
    for name, (shape, dt) in fmt.plane_shapes(host_pages * L * P).items():
        pool[name] = jax.device_put(np.zeros(shape, dt), host)
    state = OffloadState(
        page_table=jnp.full((B, pages_per_session), -1, jnp.int32),
        host_len=jnp.zeros((B,), jnp.int32),
        ring={n: jnp.zeros(s, d) for n, (s, d) in fmt.plane_shapes(L, B, R).items()},
        hot={n: jnp.zeros(s, d) for n, (s, d) in fmt.plane_shapes(L, B, H).items()},
        slot_of_position=jnp.full((L, B, N), -1, jnp.int32),
        position_of_slot=jnp.full((L, B, H), -1, jnp.int32),
        pin_round=jnp.full((L, B, H), -1, jnp.int32),
        rounds=jnp.zeros((L, B), jnp.int32),
        clock=jnp.zeros((L, B), jnp.int32),
        counters=jnp.zeros((L, B, len(COUNTERS)), jnp.int32),
        copybacks=jnp.zeros((B,), jnp.int32),
        page_rows=P,
    )
    from glm53.cache import commit
    return cache.replace(history=pool, offload=commit(state), mode="offload")


# ----------------------------------------------------------------------------------------------------------------
# Inside the jitted step
# ----------------------------------------------------------------------------------------------------------------
@jax.named_scope("offload_ring_write")
def write_rows(cache, layer: int, latent: Array, rope: Array, positions: Array):
    """New rows go to the ring only; host memory gets them by copyback once a page is complete."""
    st: OffloadState = cache.offload
    planes = kv_formats.pack(kv_formats.get_format(cache.kv_format), latent, rope)
    R = st.ring_rows
    B = positions.shape[0]
    b_idx = jnp.broadcast_to(jnp.arange(B)[:, None], positions.shape)
    slot = jnp.where(positions < cache.capacity, positions % R, R)  # padding tokens: dropped
    ring = {n: st.ring[n].at[layer, b_idx, slot].set(planes[n].astype(st.ring[n].dtype), mode="drop")
            for n in st.ring}
    return cache.replace(offload=st.replace(ring=ring))


@jax.named_scope("offload_classify")
def classify(st: OffloadState, layer: int, positions: Array, num_layers: int):
    """Source (0 ring, 1 hot, 2 host) and flat row of each selected position ``[B, M]``, plus the hot slot."""
    from kernels_pallas.hot_gather import HOST, HOT, RING

    B, M = positions.shape
    N = st.slot_of_position.shape[2]
    P, R, H = st.page_rows, st.ring_rows, st.hot_rows
    b = jnp.arange(B, dtype=jnp.int32)[:, None]
    in_ring = positions >= st.host_len[:, None]
    slot = jnp.take_along_axis(st.slot_of_position[layer], jnp.clip(positions, 0, N - 1), axis=1)
    hit = ~in_ring & (slot >= 0)
    page = jnp.take_along_axis(st.page_table, positions // P, axis=1)
    ring_row = (layer * B + b) * R + positions % R
    hot_row = (layer * B + b) * H + jnp.maximum(slot, 0)
    host_row = (jnp.maximum(page, 0) * num_layers + layer) * P + positions % P
    source = jnp.where(in_ring, RING, jnp.where(hit, HOT, HOST)).astype(jnp.int32)
    row = jnp.where(in_ring, ring_row, jnp.where(hit, hot_row, host_row)).astype(jnp.int32)
    return source, row, slot


def gather_rows(cache, layer: int, selected: Array, valid: Array, dtype):
    """One round of one layer: read the selected rows (ring / hit / miss) and install the misses for later rounds.

    Decode rounds (one token) leave their fill to ``finish_round`` at the end of the step, batched over the layers
    (see there); rounds of many tokens (prefill chunks, verify) fill right away, so the gathered rows they keep for
    the fill are one layer's, not every layer's (a 1,024-token prefill chunk gathers ~1.4 GB of rows per layer).
    """
    from kernels_pallas import ops

    st: OffloadState = cache.offload
    B, T, K = selected.shape
    pos = selected.reshape(B, T * K).astype(jnp.int32)
    source, row, slot = classify(st, layer, pos, cache.num_layers)
    with jax.named_scope("offload_gather"):
        ring = {n: a.reshape(-1, a.shape[-1]) for n, a in st.ring.items()}
        hot = {n: a.reshape(-1, a.shape[-1]) for n, a in st.hot.items()}
        latent, rope, packed = ops.hot_gather(source.reshape(-1), row.reshape(-1), ring, hot, cache.history,
                                              kv_format=cache.kv_format, out_dtype=dtype)
    packed = {n: v.reshape(B, T * K, -1) for n, v in packed.items()}
    round_ = dict(layer=layer, pos=pos, source=source, slot=slot, valid=valid.reshape(B, T * K), packed=packed)
    if T == 1:
        st = st.replace(pending=(st.pending or ()) + (round_,))
    else:
        with jax.named_scope("offload_fill"):
            st = _fill_layers(st, [round_], distinct=False)
    return latent.reshape(B, T, K, -1), rope.reshape(B, T, K, -1), cache.replace(offload=st)


@jax.named_scope("offload_fill")
def finish_round(cache):
    """Install every layer's misses of this decode step into victim slots, in one batched pass over the layers.

    Why at the end of the step and not right after each layer's gather: a layer's fill only has to happen before
    that layer's next gather (next step), and the layers' hot caches are independent, so the result is the same;
    but one pass over [layers, sessions] launches the small kernels of a fill once per step instead of once per
    layer, which was most of what offload added to a decode step (measured on the H200).
    """
    st: OffloadState = cache.offload
    if not st.pending:
        return cache
    # A single query's top-k positions are distinct: no deduplication (no sort) needed.
    st = _fill_layers(st, list(st.pending), distinct=True)
    return cache.replace(offload=st.replace(pending=None))


def _fill_layers(st: OffloadState, items: list, distinct: bool) -> OffloadState:
    """Fill for the rounds in ``items`` (one per layer). ``distinct``: no position repeats within a round.

    The bookkeeping (pins, victims, slot maps, clock, counters) is ``kernels_pallas.fill_round``, one Pallas
    program per layer and session on GPUs for decode rounds; the rows are then copied by ``fill_rows``, only the
    ``n_fill`` real ones, from the gathers' own buffers."""
    from kernels_pallas import ops
    from kernels_pallas.fill_round import MAP_NAMES

    layers = tuple(p["layer"] for p in items)
    B, M = items[0]["pos"].shape
    H = st.hot_rows
    maps, entry, victim, n_fill = ops.fill_round(
        {n: getattr(st, n) for n in MAP_NAMES},
        tuple({k: p[k] for k in ("pos", "source", "slot", "valid")} for p in items),
        layers=layers, hot_rows=H, distinct=distinct)
    hot = ops.fill_rows({n: a.reshape(-1, a.shape[-1]) for n, a in st.hot.items()},
                        [{n: v.reshape(B * M, -1) for n, v in p["packed"].items()} for p in items],
                        entry, victim, n_fill, layers=layers, sessions=B, hot_rows=H)
    L = st.slot_of_position.shape[0]
    return st.replace(hot={n: hot[n].reshape(L, B, H, -1) for n in st.hot}, **maps)


# ----------------------------------------------------------------------------------------------------------------
# Between steps: copyback and page allocation (host-side bookkeeping, no device sync)
# ----------------------------------------------------------------------------------------------------------------
@functools.partial(jax.jit, donate_argnames=("history", "st"))
def _copyback(history: dict, st: OffloadState, sessions: Array, logical_pages: Array, pool_pages: Array):
    """Write ring page ``logical_pages[i]`` of session ``sessions[i]`` (all layers) to pool page ``pool_pages[i]``:
    one contiguous write per plane and page, in place."""
    P, R = st.page_rows, st.ring_rows
    L = next(iter(st.ring.values())).shape[0]
    page_table, host_len, copybacks = st.page_table, st.host_len, st.copybacks
    for i in range(sessions.shape[0]):
        s, lp, pp = sessions[i], logical_pages[i], pool_pages[i]
        start = (lp * P) % R
        for name in history:
            ring = st.ring[name]
            rows = jax.lax.dynamic_slice(ring, (0, s, start, 0), (L, 1, P, ring.shape[-1])).reshape(L * P, -1)
            history[name] = jax.lax.dynamic_update_slice(
                history[name], jax.device_put(rows, jax.memory.Space.Host), (pp * L * P, 0))
        repeat = (page_table[s, lp] == pp) & (host_len[s] >= (lp + 1) * P)  # a padding entry: already written
        page_table = page_table.at[s, lp].set(pp)
        host_len = host_len.at[s].set(jnp.maximum(host_len[s], (lp + 1) * P))
        copybacks = copybacks.at[s].add(jnp.where(repeat, 0, 1))
    return history, st.replace(page_table=page_table, host_len=host_len, copybacks=copybacks)


class Driver:
    """Host-side mirror of lengths, host lengths and the pool's free pages for one offload cache.

    Everything here is known on the host without reading the device (lengths advance by the tokens each step
    writes), so deciding when to copy back costs no synchronisation. It holds no device arrays: the cache pytree
    stays the single source of truth on the device.
    """

    def __init__(self, cache):
        st: OffloadState = cache.offload
        self.batch = cache.batch
        self.page_rows = st.page_rows
        self.ring_rows = st.ring_rows
        self.capacity = cache.capacity
        L = cache.num_layers
        self.pool_pages = next(iter(cache.history.values())).shape[0] // (L * st.page_rows)
        self.lengths = np.zeros(self.batch, np.int64)
        self.host_len = np.zeros(self.batch, np.int64)
        self.free_pages = collections.deque(range(self.pool_pages))

    def before_step(self, n_tokens: np.ndarray) -> None:
        """Refuse a step whose new rows would overrun the ring or the capacity (never corrupt a session)."""
        n_tokens = np.asarray(n_tokens)
        pending = self.lengths - self.host_len + n_tokens
        if (pending > self.ring_rows).any():
            b = int(np.argmax(pending > self.ring_rows))
            raise ValueError(f"session {b}: {int(pending[b])} rows would wait for copyback but the ring holds "
                             f"{self.ring_rows}; step at most prefill_chunk tokens at a time")
        if (self.lengths + n_tokens > self.capacity).any():
            b = int(np.argmax(self.lengths + n_tokens > self.capacity))
            raise ValueError(f"session {b}: {int(self.lengths[b] + n_tokens[b])} rows exceed the cache capacity "
                             f"of {self.capacity} rows")

    def after_step(self, cache, n_tokens: np.ndarray):
        """Advance the mirrors by the rows a step wrote and copy every completed page back, all in one call."""
        self.lengths += np.asarray(n_tokens, np.int64)
        due = (self.lengths - self.host_len) // self.page_rows
        if due.sum() > len(self.free_pages):
            # Nothing is taken or written: the new rows stay in the ring, and the next step is refused by
            # before_step (the ring would overrun) instead of losing rows.
            raise MemoryError(f"host page pool exhausted: {int(due.sum())} pages due, {len(self.free_pages)} free "
                              f"of {self.pool_pages} pages of {self.page_rows} rows; raise cache.host_pool_rows "
                              "or admit fewer sessions")
        sessions, lpages, ppages = [], [], []
        for b in range(self.batch):
            for _ in range(int(due[b])):
                sessions.append(b)
                lpages.append(int(self.host_len[b] // self.page_rows))
                ppages.append(self.free_pages.popleft())
                self.host_len[b] += self.page_rows
        if not sessions:
            return cache
        # Pad to a power of two by repeating the last page (rewriting it is idempotent), so the copyback compiles
        # for a handful of sizes instead of every count a step can produce.
        pad = (1 << (len(sessions) - 1).bit_length()) - len(sessions)
        sessions, lpages, ppages = (x + x[-1:] * pad for x in (sessions, lpages, ppages))
        history, st = _copyback(cache.history, cache.offload, jnp.asarray(sessions, jnp.int32),
                                jnp.asarray(lpages, jnp.int32), jnp.asarray(ppages, jnp.int32))
        return cache.replace(history=history, offload=st)


# ----------------------------------------------------------------------------------------------------------------
# Stats
# ----------------------------------------------------------------------------------------------------------------
def cache_stats(cache, since: dict | None = None) -> dict[str, Any]:
    """Per-layer counters (summed over sessions) and the bytes moved, as plain Python numbers. With ``since`` (an
    earlier result, e.g. right after prefill) a ``"decode"`` entry gives the figures accumulated after it."""
    st: OffloadState = cache.offload
    c = np.asarray(jax.device_get(st.counters)).astype(np.int64).sum(axis=1)  # [L, counters]
    row_bytes = kv_formats.get_format(cache.kv_format).bytes_per_row
    per = {name: c[:, i].tolist() for i, name in enumerate(COUNTERS)}
    lookups = c[:, 0] + c[:, 1]
    per["hit_rate"] = [float(h / n) if n else 1.0 for h, n in zip(c[:, 0], lookups)]
    per["bytes_from_host"] = (c[:, 1] * row_bytes).tolist()
    pages = int(np.asarray(jax.device_get(st.copybacks)).sum())
    L = cache.num_layers
    out = {
        "per_layer": per,
        "hit_rate": float(c[:, 0].sum() / max(lookups.sum(), 1)),
        "hits": int(c[:, 0].sum()), "misses": int(c[:, 1].sum()), "ring_reads": int(c[:, 2].sum()),
        "fills": int(c[:, 3].sum()), "evictions": int(c[:, 4].sum()),
        "bytes_from_host": int(c[:, 1].sum() * row_bytes),
        "copybacks": pages, "bytes_to_host": int(pages * st.page_rows * L * row_bytes),
        "hot_rows": st.hot_rows, "ring_rows": st.ring_rows, "page_rows": st.page_rows,
    }
    if since is not None:
        d = {k: out[k] - since[k] for k in ("hits", "misses", "ring_reads", "fills", "evictions",
                                           "bytes_from_host", "copybacks", "bytes_to_host")}
        d["hit_rate"] = d["hits"] / max(d["hits"] + d["misses"], 1)
        out["decode"] = d
    return out
