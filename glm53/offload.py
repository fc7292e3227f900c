"""Offload mode: the MLA history in host memory (``pinned_host``), a bounded hot cache on the accelerator.

This is the article's final design ("let the GPU manage the hot cache directly") as data plus pure functions, the
second implementation of the cache interface in ``glm53.cache``:

* **Host history: a paged pool.** Every session's rows live in pages of ``copyback_every`` (P) rows; a page holds
  that span of rows for *all* cache layers, contiguously (flat planes ``[pages * L * P, W]``, row of (page, layer,
  r) at ``(page * L + layer) * P + r``), so the copy of one page is L contiguous blocks. A session's history is
  never contiguous and never copied when it grows: the engine assigns pool pages to a session's page table ahead
  of the steps that fill them (admission counts pages, not lengths), and a page, once written, is immutable, so
  ``fork`` shares it. Per-session arrays with a capacity were rejected: growing one means copying the history, and
  sessions of different lengths would waste the pool.
* **Device state** (per layer and slot): ``hot`` slots, ``slot_of_position`` and its inverse ``position_of_slot``,
  pins (``pin_round``: slots the latest round read as hits), the circular ``clock``, the recent ``ring`` of rows not
  yet in host memory, the ``page_table``, ``host_len`` (rows in host pages) and counters. The hot cache and the ring
  are stored as the flat planes the kernels take, ``[L * S * H + pad, W]`` and ``[L * S * R + pad, W]`` (row of
  (layer, slot, h) at ``(layer * S + slot) * H + h``), where ``pad`` rows, past every row a slot addresses, are
  only there when a 1-byte plane would otherwise fall in the range Pallas' Triton lowering misaddresses
  (``glm53.cache.addressable_planes``): that plane alone grows, by rows, instead of every per-slot array by
  phantom session slots.
* **Copyback inside the step, before any read of the pool.** A step writes every page whose rows became final in
  earlier steps (all layers, the MTP layer one position behind) from the ring to its pool page with one Pallas
  kernel (``kernels_pallas.copy_blocks``, zero-copy writes) before its first read: in decode and verify steps right
  after layer 0's ring write, in chunk steps first (``begin_step`` says why). Measured on the H200
  (probes recorded in experiments/results/copyback_in_step.json): a separate copyback call between steps
  blocked the host for ~3x a step (its donation of the pool waits for the queued steps that read it) and made every
  copyback step a stall; a write placed *after* the step's reads of the pool made XLA copy the whole pool twice per
  step (it cannot order an aliased write after readers it does not depend on); written first, nothing is copied,
  steps that copy take no longer than others, and the wall time per step is that of a step without copyback.
  Only final rows are ever written: pages whose rows are all below ``min(lengths, mtp_lengths)``.
* **One round per layer** (``gather_rows``): classify each selected position — ``p >= host_len``: ring;
  ``slot_of_position[p] >= 0``: hit; else miss — and one Pallas kernel (``kernels_pallas.hot_gather``) reads ring
  and hot rows from device memory and misses straight from host memory, returning them dequantised for attention
  and packed for the fill. Decode and MTP-verify steps then install the misses into victim slots for *later*
  rounds, for every layer at once at the end of the step (``finish_step``; per-layer fills cost ~15% of decode
  speed on the H200). The fill's bookkeeping is ``kernels_pallas.fill_round`` (one program per layer and lane; it
  deduplicates positions that several verify rows or drafts selected), its row copy ``fill_rows``. Visibility
  comes from data dependence: fills happen after every read of the step, so a slot filled in a round is a hit
  source only in a later step, and duplicate misses of one round each read host memory (the article's rule).
  Victims are the first unpinned slots from ``clock`` onward in circular order (no clock-with-reference-bits
  pathology).
* **Prefill and large appends read the history in bulk** (``step.bulk``): per layer, the lane's whole host history
  is copied to a transient device buffer (one Pallas pass over its pages, ~45 GB/s zero-copy) and the chunk's
  queries gather from it and the ring. A chunk of C queries selects up to C x index_topk rows, far more than the
  history at the lengths where chunks run (1,024 x 2,048 = 2M entries against 50K rows), so one bulk read per layer
  replaces millions of scattered PCIe reads; the engine picks bulk when C x index_topk >= host rows. The buffer's
  creation is tied to the layer's own selection, so at most one layer's buffer is alive: transient device memory is
  ``lanes x capacity x row bytes`` (``Engine.memory_report`` counts it). Bulk rounds leave the hot cache as it is.

Resident and offload read the same packed bytes for every position (rows are packed once, when written), so their
logits and tokens are bit-identical; the tests check it in every path.

**Scale.** Row indices are int32 everywhere, in the XLA glue here (``(page * L + layer) * P + r`` into the pool,
``(layer * S + slot) * N + p`` into the slot map, ``(layer * S + slot) * H + h`` / ``* R + r`` into the hot cache and
ring, ``b * N + p`` into a bulk buffer) and in the kernels; byte offsets are the kernels' business, 64-bit for
any operand past 2**32 bytes (``kernels_pallas.hot_gather``, "Addressing"). Every product above is below the row
count of the array it indexes (a bulk buffer's lanes x capacity rows are fewer than the slot map's entries), so
``validate`` refusing arrays of 2**31 rows or more (``indexed_rows``; padding rows stay far below that: a padded
plane has just over 2**32 bytes) makes all of them safe: the target of 16 sessions x 1,048,576 rows x 9 cache
layers is 151M pool rows (a 77 GB int8 latent plane) and a 151M-entry slot map.
``slot_of_position`` is int16 whenever the hot cache has at most 32,768 slots (``slot_map_dtype``), the design's 2
bytes per position. The pool is allocated once, in place, plane by plane (``allocate_pool``).
"""

from __future__ import annotations

import os

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import tqdm

from glm53.cache import (CacheBase, Round, Sessions, addressable_planes, init_index_keys, init_sessions, key_slots,
                         padded_rows, place)
from glm53.config import CacheConfig, ConfigError, ModelConfig
from kernels_pallas import index_math as im
from kernels_pallas import kv_formats, ops
from kernels_pallas.hot_gather import HOST, HOT, MAX_PLANE_ROWS, RING

COUNTERS = ("hits", "misses", "ring_reads", "fills", "evictions")  # the fill kernel's order
POLICY_STATE = {"circular": (), "lfu": ("hits", "last_use")}  # OffloadCache.policy_state's arrays per policy
LFU_MAX_HITS, LFU_MAX_AGE = 1023, (1 << 21) - 1  # the LFU key: 10 bits of hits, 21 of age
Array = jax.Array

# Verify rounds read T = depth + 1 <= 4 rows per session; decode 1. Chunks of more tokens never fill.
MAX_VERIFY_ROWS = 4


@flax.struct.dataclass
class OffloadCache(CacheBase):
    sessions: Sessions
    index_keys: Array
    index_key_scale: Array | None
    pool: dict  # plane -> [pool_pages * L * P, W] in pinned_host memory
    page_table: Array  # int32[S, N // P]: logical page -> pool page (-1 = none assigned)
    host_len: Array  # int32[S]: rows [0, host_len) are in host pages (a multiple of P); the rest only in the ring
    ring: dict  # plane -> [L * S * R + pad, W]: position p of (layer, slot) at row (layer * S + slot) * R + p % R
    hot: dict  # plane -> [L * S * H + pad, W]: hot slot h of (layer, slot) at row (layer * S + slot) * H + h
    slot_of_position: Array  # int16 / int32[L, S, N] (slot_map_dtype): hot slot holding position p (-1 = not hot)
    position_of_slot: Array  # int32[L, S, H]: position held by a slot (-1 = empty)
    # Pins as round stamps: a slot is pinned by a round when it was read there as a hit (never that round's victim).
    pin_round: Array  # int32[L, S, H]
    rounds: Array  # int32[L, S]: fill rounds completed
    clock: Array  # int32[L, S]: where the next victim search starts
    counters: Array  # int32[L, S, len(COUNTERS)]
    # int32[L, S]: pages (of page_rows rows) read from host memory by bulk (prefill / append) rounds. Pages, not
    # rows: a 1M-token prefill reads ~5.4e8 rows per layer, so rows overflow int32 at ~2M tokens; pages at ~128M.
    bulk_pages: Array
    copybacks: Array  # int32[S]: pages written to host memory
    unassigned: Array  # int32[S]: pages that were due with no pool page assigned (an engine bug if ever > 0)
    # What the replacement policy remembers per hot slot beyond the maps: {} for "circular"; for "lfu",
    # "hits" (valid hits since the slot was filled, once per round) and "last_use" (the round of its last valid
    # hit or fill), int32[L, S, H] each.
    policy_state: dict
    kv_format: str = flax.struct.field(pytree_node=False, default="bf16")
    indexer_precision: str = flax.struct.field(pytree_node=False, default="highest")
    key_slot_of_layer: tuple = flax.struct.field(pytree_node=False, default=())
    _has_mtp_layer: bool = flax.struct.field(pytree_node=False, default=False)
    # Whether this cache's last layer is the MTP layer (a pipeline stage's cache may hold main layers only, while
    # its sessions keep the model's MTP lag: _has_mtp_layer).
    _holds_mtp_layer: bool = flax.struct.field(pytree_node=False, default=False)
    policy: str = flax.struct.field(pytree_node=False, default="circular")  # CacheConfig.policy
    page_rows: int = flax.struct.field(pytree_node=False, default=64)
    _ring_rows: int = flax.struct.field(pytree_node=False, default=0)  # R (the planes may hold padding rows)
    _copy_due: int = flax.struct.field(pytree_node=False, default=0)  # inside a step: pages left for layer 0's write

    mode = "offload"

    @property
    def ring_rows(self) -> int:
        return self._ring_rows

    @property
    def hot_rows(self) -> int:
        return int(self.position_of_slot.shape[2])

    @property
    def pool_pages(self) -> int:
        return int(next(iter(self.pool.values())).shape[0]) // (self.num_layers * self.page_rows)

    def hot_planes(self) -> dict:
        """The hot cache as ``{plane: [L, S, H, W]}`` (padding rows dropped; a copy, for inspection and tests)."""
        L, S, H = self.num_layers, self.num_slots, self.hot_rows
        return {n: a[:L * S * H].reshape(L, S, H, -1) for n, a in self.hot.items()}

    def ring_planes(self) -> dict:
        """The ring as ``{plane: [L, S, R, W]}`` (padding rows dropped; a copy, for inspection and tests)."""
        L, S, R = self.num_layers, self.num_slots, self.ring_rows
        return {n: a[:L * S * R].reshape(L, S, R, -1) for n, a in self.ring.items()}

    # ------------------------------------------------------------------------------------------------------------
    # Inside a step
    # ------------------------------------------------------------------------------------------------------------
    def begin_step(self, step) -> "OffloadCache":
        """Write every page that became final before this step (at most ``step.copy_pages`` per lane) to its pool
        page, before anything reads the pool: right after layer 0's ring write when the ring can hold what that
        needs (decode and verify steps), else now (chunk steps).

        Where the copy runs decides what XLA copies. Its pool write must come before every read of the pool, or XLA
        copies the whole pool (module doc). Its read of the ring must be ordered against the step's ring writes
        by data, or XLA keeps the old ring alive with a copy of the whole ring: at the step's start nothing made
        layer 0's write wait for it, and the H200 ran two ~94 MB ring copies per 10-session decode step
        (``experiments/results/profile_decode_50k_b10_43c288c.json``, gone in ``profile_decode_50k_b10.json``; an
        optimization barrier orders nothing, it is removed before copy insertion). After layer 0's write the copy
        reads the written ring, and every later write depends on layer 0's gather, which reads the pool the copy
        wrote. The ring then holds, at layer 0's write, the rows the copy is about to take (under a page past the
        last copied one, and the previous step's rows) beside this step's: ``copy_after_write`` checks that they
        fit (a chunk step's do not: it copies first and pays one ring copy per chunk, ~0.1% of a 1,024-token chunk
        step)."""
        G = step.copy_pages
        if not G:
            return self
        if copy_after_write(self.page_rows, self.ring_rows, step.positions.shape[1]):
            return self.replace(_copy_due=G)
        with jax.named_scope("offload_copyback"):
            return self._copyback(step.lanes, G, step.kernels)

    def _copyback(self, lanes, G: int, kernels: str) -> "OffloadCache":
        S, L, P, R = self.num_slots, self.num_layers, self.page_rows, self.ring_rows
        slot = lanes.slot
        pages = self.page_table.shape[1]
        first = im.div(self.host_len[slot], P)
        due = jnp.maximum(im.div(self.committed()[slot], P) - first, 0)
        g = jnp.arange(G, dtype=jnp.int32)
        k = first[:, None] + g[None, :]  # [B, G] logical pages
        pool_page = jnp.take_along_axis(self.page_table[slot], jnp.clip(k, 0, pages - 1), axis=1)
        want = lanes.active[:, None] & (g[None, :] < due[:, None])
        ok = want & (pool_page >= 0)
        # Pages are written in order: stop at the first one without a pool page (host_len stays contiguous).
        n_written = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)  # [B]
        do = g[None, :] < n_written[:, None]
        l = jnp.arange(L, dtype=jnp.int32)[None, None, :]
        src = (l * S + slot[:, None, None]) * R + im.rem(k * P, R)[..., None]
        dst = (jnp.maximum(pool_page, 0)[..., None] * L + l) * P
        count = jnp.broadcast_to(jnp.where(do, P, 0)[..., None], src.shape)
        pool = ops.copy_blocks(self.pool, self.ring, src.reshape(-1).astype(jnp.int32),
                               dst.reshape(-1).astype(jnp.int32), count.reshape(-1).astype(jnp.int32),
                               block_size=P, impl=kernels)
        ws = lanes.write_slot(S)
        copybacks = self.copybacks.at[ws].add(n_written, mode="drop")
        unassigned = self.unassigned.at[ws].add(jnp.sum(want & ~ok, axis=1).astype(jnp.int32), mode="drop")
        # host_len, and at the step's end the lengths, are updated in place. The counters above and the copy's
        # addresses read their old values, but nothing downstream of the step reads the counters back, so no data
        # path ordered those reads before the in-place writes and XLA kept each old value alive with two copies
        # (host_len, lengths, mtp_lengths: six ~1 us MemcpyD2D a decode step on the H200,
        # profile_decode_50k_b10_drift0.001_15cb82b.json). Counters and addresses are never negative, which XLA
        # cannot know: the host_len update depends on them, and every later read of host_len (each layer's
        # classify, hence the step's tokens and its length updates) on it.
        read = (jnp.min(copybacks) >= 0) & (jnp.min(unassigned) >= 0) & (jnp.min(src) >= 0) & (jnp.min(dst) >= 0)
        return self.replace(pool=pool, host_len=self.host_len.at[ws].add(jnp.where(read, n_written * P, 0),
                                                                         mode="drop"),
                            copybacks=copybacks, unassigned=unassigned)

    @jax.named_scope("offload_ring_write")
    def write_rows(self, layer: int, latent: Array, rope: Array, step) -> "OffloadCache":
        """New rows go to the ring only; host memory gets them once their page is final."""
        planes = kv_formats.pack(self.fmt, latent, rope)
        S, R = self.num_slots, self.ring_rows
        pos = step.write_positions
        row = (layer * S + step.lanes.slot[:, None]) * R + im.rem(pos, R)  # pos >= 0: capacity where nothing writes
        write = step.lanes.active[:, None] & (pos < self.capacity)  # padding tokens and inactive lanes: dropped
        B, T = pos.shape
        ring = {n: a.at[jnp.where(write, row, a.shape[0]).reshape(-1)]
                .set(planes[n].reshape(B * T, -1).astype(a.dtype), mode="drop")
                for n, a in self.ring.items()}
        cache = self.replace(ring=ring)
        if layer == 0 and self._copy_due:  # the copyback begin_step placed here
            with jax.named_scope("offload_copyback"):
                cache = cache.replace(_copy_due=0)._copyback(step.lanes, self._copy_due, step.kernels)
        return cache

    @jax.named_scope("offload_classify")
    def classify(self, layer: int, positions: Array, lanes) -> tuple[Array, Array, Array]:
        """Source (ring / hot / host) and flat row of each selected position ``[B, M]`` of one layer, and the hot
        slot of hits."""
        S, L, N = self.num_slots, self.num_layers, self.capacity
        P, R, H = self.page_rows, self.ring_rows, self.hot_rows
        slot = lanes.slot[:, None]
        pages = self.page_table.shape[1]
        p = jnp.clip(positions, 0, N - 1)
        in_ring = positions >= self.host_len[lanes.slot][:, None]
        # int32 from here on: the map's int16 (slot_map_dtype) is only how it is stored.
        hot_slot = im.take_rows(self.slot_of_position.reshape(-1), (layer * S + slot) * N + p).astype(jnp.int32)
        hit = ~in_ring & (hot_slot >= 0)
        page = im.take_rows(self.page_table.reshape(-1), slot * pages + im.div(p, P))
        ring_row = (layer * S + slot) * R + im.rem(p, R)
        hot_row = (layer * S + slot) * H + jnp.maximum(hot_slot, 0)
        host_row = (jnp.maximum(page, 0) * L + layer) * P + im.rem(p, P)
        source = jnp.where(in_ring, RING, jnp.where(hit, HOT, HOST)).astype(jnp.int32)
        row = jnp.where(in_ring, ring_row, jnp.where(hit, hot_row, host_row)).astype(jnp.int32)
        return source, row, hot_slot

    def gather_rows(self, layer: int, selected: Array, valid: Array, step, dtype):
        """One round of one layer: the selected rows from the ring, the hot cache, host memory (or the bulk
        buffer). Returns ``(latent [B,T,K,512], rope [B,T,K,64], cache, round)``; ``round`` is what the fill at the
        end of the step needs (decode / verify steps), else None."""
        B, T, K = selected.shape
        pos = selected.reshape(B, T * K).astype(jnp.int32)
        if step.bulk:
            latent, rope, cache = self._gather_bulk(layer, pos, valid, step, dtype)
            return latent.reshape(B, T, K, -1), rope.reshape(B, T, K, -1), cache, None
        source, row, hot_slot = self.classify(layer, pos, step.lanes)
        with jax.named_scope("offload_gather"):
            latent, rope, packed = ops.hot_gather(source.reshape(-1), row.reshape(-1), self.ring,
                                                  self.hot, self.pool, kv_format=self.kv_format,
                                                  out_dtype=dtype, impl=step.kernels)
        valid = valid.reshape(B, T * K) & step.lanes.active[:, None]
        cache, round_ = self, None
        if step.fill:
            round_ = Round(pos=pos, source=source, slot=hot_slot, valid=valid,
                           packed={n: v.reshape(B, T * K, -1) for n, v in packed.items()}, layer=layer)
        else:  # a read-only round (small appends): count it, fill nothing
            cache = self._count(layer, step.lanes, source, valid)
        return latent.reshape(B, T, K, -1), rope.reshape(B, T, K, -1), cache, round_

    def _count(self, layer: int, lanes, source: Array, valid: Array) -> "OffloadCache":
        tally = jnp.stack([jnp.sum((source == s) & valid, axis=1) for s in (HOT, HOST, RING)], axis=1)
        add = jnp.concatenate([tally, jnp.zeros((tally.shape[0], 2), jnp.int32)], axis=1).astype(jnp.int32)
        ws = lanes.write_slot(self.num_slots)
        return self.replace(counters=self.counters.at[layer, ws].add(add, mode="drop"))

    def _gather_bulk(self, layer: int, pos: Array, valid: Array, step, dtype):
        """Bulk round: copy the lanes' host history of this layer to a device buffer, then gather from it and the
        ring."""
        B, M = pos.shape
        S, L, N, P, R = self.num_slots, self.num_layers, self.capacity, self.page_rows, self.ring_rows
        lanes = step.lanes
        slot = lanes.slot
        k = jnp.arange(N // P, dtype=jnp.int32)[None, :]
        host_len = self.host_len[slot]
        pool_page = self.page_table[slot]  # [B, N // P]
        # Only the pages the chunk's queries read (selected or not: every row the gather below reads is a real one):
        # a local selection copies a few pages, the model's own indexer over a long prompt nearly all.
        page_of = im.div(jnp.clip(pos, 0, N - 1), P)
        touched = jnp.zeros((B, N // P), bool).at[jnp.arange(B)[:, None], page_of].set(True)
        count = jnp.where(lanes.active[:, None] & (k * P < host_len[:, None]) & (pool_page >= 0) & touched, P, 0)
        src = (jnp.maximum(pool_page, 0) * L + layer) * P
        dst = jnp.arange(B, dtype=jnp.int32)[:, None] * N + k * P
        # Tie the copy to this layer's selection: without it XLA may start every layer's copy at once, and the
        # transient device memory would be every layer's history instead of one.
        src, pos = jax.lax.optimization_barrier((src, pos))
        with jax.named_scope("offload_bulk_read"):
            buf = _device_buffer(self.pool, B * N)
            buf = ops.copy_blocks(buf, self.pool, src.reshape(-1).astype(jnp.int32),
                                  dst.reshape(-1).astype(jnp.int32), count.reshape(-1).astype(jnp.int32),
                                  block_size=P, impl=step.kernels)
        p = jnp.clip(pos, 0, N - 1)
        in_ring = pos >= host_len[:, None]
        ring_row = (layer * S + slot[:, None]) * R + im.rem(p, R)
        buf_row = jnp.arange(B, dtype=jnp.int32)[:, None] * N + p
        source = jnp.where(in_ring, RING, HOT).astype(jnp.int32)
        row = jnp.where(in_ring, ring_row, buf_row).astype(jnp.int32)
        with jax.named_scope("offload_gather"):
            latent, rope, _ = ops.hot_gather(source.reshape(-1), row.reshape(-1), self.ring, buf, buf,
                                             kv_format=self.kv_format, out_dtype=dtype, impl=step.kernels)
        ws = lanes.write_slot(S)
        pages_read = jnp.sum(count > 0, axis=1).astype(jnp.int32)
        cache = self.replace(bulk_pages=self.bulk_pages.at[layer, ws].add(pages_read, mode="drop"))
        return latent, rope, cache

    @jax.named_scope("offload_fill")
    def finish_step(self, rounds, step) -> "OffloadCache":
        """Install every layer's misses of this step into victim slots, in one batched pass over the layers.

        A layer's fill only has to happen before that layer's next gather (next step), and the layers' hot caches
        are independent, so the result is the same as filling after each gather; one pass over [layers, lanes]
        launches the fill's kernels once per step instead of once per layer. A layer with several rounds in one
        step (the MTP layer, once per draft) gets their entries concatenated: their fills then also happen after
        all of them read, as the visibility rule requires."""
        rounds = [r for r in (rounds or ()) if r is not None]
        if not rounds or not step.fill:
            return self
        layers, merged, most = merge_rounds(rounds)
        H, S = self.hot_rows, self.num_slots
        repeats = max(step.repeats, most)
        maps = dict(pin_round=self.pin_round, position_of_slot=self.position_of_slot,
                    slot_of_position=self.slot_of_position, rounds=self.rounds, clock=self.clock,
                    counters=self.counters)
        keys = self._lfu_keys(layers, step.lanes) if self.policy == "lfu" else None
        maps, entry, victim, n_fill = ops.fill_round(
            maps, tuple(dict(pos=r.pos, source=r.source, slot=r.slot, valid=r.valid) for r in merged),
            step.lanes.slot, step.lanes.active, layers=layers, hot_rows=H, distinct=repeats == 1,
            max_repeats=repeats, impl=step.kernels, victim_keys=keys)
        policy_state = self.policy_state
        if self.policy == "lfu":
            policy_state = self._lfu_update(layers, merged, step.lanes, victim, n_fill)
        # the gathered rows as each layer's round has them: fill_rows takes layers of different widths
        hot = ops.fill_rows(self.hot, tuple({n: v.reshape(-1, v.shape[-1]) for n, v in r.packed.items()}
                                            for r in merged),
                            entry, victim, n_fill, step.lanes.slot, layers=layers, sessions=S, hot_rows=H,
                            impl=step.kernels)
        return self.replace(hot=hot, policy_state=policy_state, **maps)

    # LFU (CacheConfig.policy="lfu"): victims are the unpinned slots hit least often since their fill (counts
    # capped at 1,023), then the least recently used (ages capped at 2**21 - 1 rounds), then the lower slot; empty
    # slots first. glm53.policies replays the same rule offline ("lfu"), to the engine's counters.
    def _lfu_keys(self, layers: tuple, lanes) -> Array:
        l_b, s_b = self._lane_index(layers, lanes)
        this_round = self.rounds[l_b, s_b][..., None] + 1
        hits = jnp.minimum(self.policy_state["hits"][l_b, s_b], LFU_MAX_HITS)
        age = jnp.clip(this_round - self.policy_state["last_use"][l_b, s_b], 0, LFU_MAX_AGE)
        key = (hits << 21) | (LFU_MAX_AGE - age)
        return jnp.where(self.position_of_slot[l_b, s_b] < 0, -1, key).astype(jnp.int32)

    def _lfu_update(self, layers: tuple, merged: list, lanes, victim: Array, n_fill: Array) -> dict:
        """This round's valid hits count once per slot and stamp its use; filled slots start over."""
        l_b, s_b = self._lane_index(layers, lanes)
        H, S = self.hot_rows, self.num_slots
        w_b = jnp.broadcast_to(jnp.where(lanes.active, lanes.slot, S)[None, :], l_b.shape)
        this_round = self.rounds[l_b, s_b] + 1  # [Lp, B]: the round the fill just made
        hit_slot = jnp.stack([jnp.where((r.source == HOT) & r.valid, r.slot, H) for r in merged])  # [Lp, B, M]
        Lp, B, M = hit_slot.shape
        ii, bb = jnp.meshgrid(jnp.arange(Lp), jnp.arange(B), indexing="ij")
        touched = jnp.zeros((Lp, B, H), bool).at[ii[..., None], bb[..., None], hit_slot].set(True, mode="drop")
        hits = self.policy_state["hits"][l_b, s_b] + touched.astype(jnp.int32)
        last = jnp.where(touched, this_round[..., None], self.policy_state["last_use"][l_b, s_b])
        F = victim.shape[-1]
        filled = jnp.where(jnp.arange(F)[None, None, :] < n_fill[..., None], victim, H)
        hits = hits.at[ii[..., None], bb[..., None], filled].set(0, mode="drop")
        last = last.at[ii[..., None], bb[..., None], filled].set(
            jnp.broadcast_to(this_round[..., None], filled.shape), mode="drop")
        return {"hits": self.policy_state["hits"].at[l_b, w_b].set(hits, mode="drop"),
                "last_use": self.policy_state["last_use"].at[l_b, w_b].set(last, mode="drop")}

    def _lane_index(self, layers: tuple, lanes) -> tuple[Array, Array]:
        B = lanes.slot.shape[0]
        l_b = jnp.broadcast_to(jnp.asarray(layers, jnp.int32)[:, None], (len(layers), B))
        return l_b, jnp.broadcast_to(lanes.slot.astype(jnp.int32)[None, :], l_b.shape)

    # ------------------------------------------------------------------------------------------------------------
    # Between steps: session lifecycle. Each is jitted by glm53.steps with the cache donated.
    # ------------------------------------------------------------------------------------------------------------
    def settle(self, lanes, pages: int, kernels: str) -> "OffloadCache":
        """A copyback call of its own (after a prefill / append, at the end of a generate): every final page of
        the lanes' sessions goes to host memory. It only writes the pool, so XLA copies nothing."""
        return self._copyback(lanes, pages, kernels)

    def clear_slot(self, slot: Array) -> "OffloadCache":
        return self.replace(
            page_table=self.page_table.at[slot].set(-1), host_len=self.host_len.at[slot].set(0),
            slot_of_position=self.slot_of_position.at[:, slot].set(-1),
            position_of_slot=self.position_of_slot.at[:, slot].set(-1),
            pin_round=self.pin_round.at[:, slot].set(-1), rounds=self.rounds.at[:, slot].set(0),
            clock=self.clock.at[:, slot].set(0), counters=self.counters.at[:, slot].set(0),
            bulk_pages=self.bulk_pages.at[:, slot].set(0), copybacks=self.copybacks.at[slot].set(0),
            unassigned=self.unassigned.at[slot].set(0),
            policy_state={n: a.at[:, slot].set(0) for n, a in self.policy_state.items()}, **self._clear_common(slot))

    def copy_slot(self, src: Array, dst: Array) -> "OffloadCache":
        """Fork: the new slot starts as a copy of every per-slot array (ring, hot cache and its maps included, so
        it keeps the parent's hit rate); its host pages are the parent's (shared: they are immutable) and its
        counters start at zero. The engine then replaces the page-table entries it must not share."""
        def cp(a, axis):
            return a.at[(slice(None),) * axis + (dst,)].set(a[(slice(None),) * axis + (src,)])

        S = self.num_slots

        def cp_rows(a, per_slot: int):  # a flat plane: each layer's block of the slot's rows, one slice at a time
            for layer in range(self.num_layers):
                block = jax.lax.dynamic_slice_in_dim(a, (layer * S + src) * per_slot, per_slot)
                a = jax.lax.dynamic_update_slice_in_dim(a, block, (layer * S + dst) * per_slot, 0)
            return a

        out = dict(page_table=cp(self.page_table, 0), host_len=cp(self.host_len, 0),
                   ring={n: cp_rows(a, self.ring_rows) for n, a in self.ring.items()},
                   hot={n: cp_rows(a, self.hot_rows) for n, a in self.hot.items()},
                   slot_of_position=cp(self.slot_of_position, 1), position_of_slot=cp(self.position_of_slot, 1),
                   pin_round=cp(self.pin_round, 1), rounds=cp(self.rounds, 1), clock=cp(self.clock, 1),
                   counters=self.counters.at[:, dst].set(0), bulk_pages=self.bulk_pages.at[:, dst].set(0),
                   copybacks=self.copybacks.at[dst].set(0), unassigned=self.unassigned.at[dst].set(0),
                   policy_state={n: cp(a, 1) for n, a in self.policy_state.items()})
        return self.replace(**out, **self._copy_common(src, dst))

    def read_pages(self, pages: Array, kernels: str) -> dict:
        """Pool pages ``pages [n]`` (all layers) copied to a device buffer ``{plane: [n * L * P, W]}``."""
        L, P = self.num_layers, self.page_rows
        n = pages.shape[0]
        starts = (pages * L * P).astype(jnp.int32)
        blocks = (starts[:, None] + jnp.arange(L, dtype=jnp.int32)[None, :] * P).reshape(-1)
        buf = _device_buffer(self.pool, n * L * P)
        return ops.copy_blocks(buf, self.pool, blocks, jnp.arange(n * L, dtype=jnp.int32) * P,
                               jnp.full((n * L,), P, jnp.int32), block_size=P, impl=kernels)

    def write_pages(self, buf: dict, pages: Array, kernels: str) -> "OffloadCache":
        """The inverse of ``read_pages``: the buffer's pages into pool pages ``pages [n]`` (a call that only
        writes the pool: see the module doc)."""
        L, P = self.num_layers, self.page_rows
        n = pages.shape[0]
        dst = ((pages * L * P).astype(jnp.int32)[:, None] + jnp.arange(L, dtype=jnp.int32)[None, :] * P).reshape(-1)
        pool = ops.copy_blocks(self.pool, buf, jnp.arange(n * L, dtype=jnp.int32) * P, dst,
                               jnp.full((n * L,), P, jnp.int32), block_size=P, impl=kernels)
        return self.replace(pool=pool)

    def set_pages(self, slot: Array, row: Array) -> "OffloadCache":
        return self.replace(page_table=self.page_table.at[slot].set(row))

    def truncate_slot(self, slot: Array, length: Array, mtp_length: Array, kernels: str) -> "OffloadCache":
        """Rollback to ``length`` rows (``mtp_length`` in the MTP layer). Rows still in the ring stay there; if
        the rollback reaches below ``host_len``, the page holding the new end comes back from host memory into
        the ring (its later rows are no longer history) and ``host_len`` drops to that page's start. Hot slots
        holding positions at or past the new ``host_len`` are emptied: those rows now live in the ring (or are
        gone), and a later copyback of new rows there must not meet a stale hot copy. The engine releases the pages
        past the new ``host_len`` and rewrites the page table."""
        S, L, N, P, R = self.num_slots, self.num_layers, self.capacity, self.page_rows, self.ring_rows
        cache = self.replace(**self._truncate_common(slot, length, mtp_length))
        c = cache.committed()[slot]
        old = self.host_len[slot]
        new = jnp.minimum(old, im.div(c, P) * P)
        k = im.div(new, P)
        reload = (c < old) & (c > new)  # the new end lies inside a page that was in host memory
        pool_page = self.page_table[slot, jnp.clip(k, 0, self.page_table.shape[1] - 1)]
        l = jnp.arange(L, dtype=jnp.int32)
        src = (jnp.maximum(pool_page, 0) * L + l) * P
        dst = (l * S + slot) * R + im.rem(k * P, R)
        count = jnp.where(reload & (pool_page >= 0), P, 0) * jnp.ones((L,), jnp.int32)
        ring = ops.copy_blocks(self.ring, self.pool, src.astype(jnp.int32), dst.astype(jnp.int32),
                               count.astype(jnp.int32), block_size=P, impl=kernels)
        pos_of_slot = self.position_of_slot[:, slot]  # [L, H]
        stale = pos_of_slot >= new
        position_of_slot = self.position_of_slot.at[:, slot].set(jnp.where(stale, -1, pos_of_slot))
        n = jnp.arange(N, dtype=jnp.int32)[None, :]
        sop = self.slot_of_position[:, slot]
        slot_of_position = self.slot_of_position.at[:, slot].set(jnp.where(n >= new, -1, sop))
        return cache.replace(ring=ring, host_len=self.host_len.at[slot].set(new), position_of_slot=position_of_slot,
                             slot_of_position=slot_of_position)

    def flush_slot(self, slot: Array, kernels: str) -> "OffloadCache":
        """The flush barrier's write (before save): the rows of the partial page past ``host_len`` go to that
        page's pool page, each layer only up to its final rows (the MTP layer one position behind). ``host_len``
        does not move: the page is not complete, and the copyback rewrites it whole once it is."""
        S, L, P, R = self.num_slots, self.num_layers, self.page_rows, self.ring_rows
        k = im.div(self.host_len[slot], P)
        pool_page = self.page_table[slot, jnp.clip(k, 0, self.page_table.shape[1] - 1)]
        l = jnp.arange(L, dtype=jnp.int32)
        final = jnp.where(l == L - 1, self.committed()[slot], self.sessions.lengths[slot]) \
            if self._holds_mtp_layer else jnp.full((L,), self.sessions.lengths[slot])
        count = jnp.where(pool_page >= 0, jnp.clip(final - k * P, 0, P), 0)
        src = (l * S + slot) * R + im.rem(k * P, R)
        dst = (jnp.maximum(pool_page, 0) * L + l) * P
        pool = ops.copy_blocks(self.pool, self.ring, src.astype(jnp.int32), dst.astype(jnp.int32),
                               count.astype(jnp.int32), block_size=P, impl=kernels)
        return self.replace(pool=pool)

    def read_slot_rows(self, slot: Array, kernels: str) -> dict:
        """Every assigned page of one slot from host memory, ``{plane: [L, N, W]}`` on the device (for save,
        after ``flush_slot``: host memory then holds every final row)."""
        L, N, P = self.num_layers, self.capacity, self.page_rows
        pages = N // P
        k = jnp.arange(pages, dtype=jnp.int32)[None, :]
        l = jnp.arange(L, dtype=jnp.int32)[:, None]
        pool_page = self.page_table[slot][None, :]
        count = jnp.broadcast_to(jnp.where(pool_page >= 0, P, 0), (L, pages))
        src = (jnp.maximum(pool_page, 0) * L + l) * P
        dst = l * N + k * P
        buf = _device_buffer(self.pool, L * N)
        buf = ops.copy_blocks(buf, self.pool, src.reshape(-1).astype(jnp.int32), dst.reshape(-1).astype(jnp.int32),
                              count.reshape(-1).astype(jnp.int32), block_size=P, impl=kernels)
        return {n: v[: L * N].reshape(L, N, -1) for n, v in buf.items()}

    def write_slot_rows(self, slot: Array, rows: dict, length: Array, mtp_length: Array, kernels: str):
        """Restore into a cleared slot whose page table the engine has set: the complete pages' rows go to their
        pool pages, the rows of the partial page to the ring; ``host_len`` is the complete pages."""
        S, L, N, P, R = self.num_slots, self.num_layers, self.capacity, self.page_rows, self.ring_rows
        c = jnp.minimum(length, mtp_length) if self._has_mtp_layer else length
        complete = im.div(c, P)
        pages = N // P
        k = jnp.arange(pages, dtype=jnp.int32)[None, :]
        l = jnp.arange(L, dtype=jnp.int32)[:, None]
        pool_page = self.page_table[slot][None, :]
        flat = {n: v.reshape(L * N, -1).astype(self.pool[n].dtype) for n, v in rows.items()}
        flat = {n: jnp.pad(v, ((0, _padded(v.shape[0], v) - v.shape[0]), (0, 0))) for n, v in flat.items()}
        count = jnp.broadcast_to(jnp.where((k < complete) & (pool_page >= 0), P, 0), (L, pages))
        pool = ops.copy_blocks(self.pool, flat, (l * N + k * P).reshape(-1).astype(jnp.int32),
                               ((jnp.maximum(pool_page, 0) * L + l) * P).reshape(-1).astype(jnp.int32),
                               count.reshape(-1).astype(jnp.int32), block_size=P, impl=kernels)
        lr = jnp.arange(L, dtype=jnp.int32)
        partial = jnp.where(complete * P < N, P, 0)  # a full slot has no partial page
        ring = ops.copy_blocks(self.ring, flat, (lr * N + complete * P).astype(jnp.int32),
                               ((lr * S + slot) * R + im.rem(complete * P, R)).astype(jnp.int32),
                               jnp.full((L,), partial, jnp.int32), block_size=P, impl=kernels)
        return self.replace(pool=pool, ring=ring, host_len=self.host_len.at[slot].set(complete * P))


def _padded(rows: int, like) -> int:
    return padded_rows(rows, like.shape[1:], like.dtype)


def _device_buffer(planes: dict, rows: int) -> dict:
    """A transient zero buffer ``{plane: [rows + pad, W]}`` shaped like ``planes`` for the kernels to read or write
    (bulk reads, save, fork): padded like the cache's own planes (``glm53.cache.padded_rows``), since a 1-byte plane
    of 2**31..2**32 elements would be misaddressed (a save of a ~500K-row session is one: 9 layers x 500K x 512)."""
    return {n: jnp.zeros((_padded(rows, a), a.shape[1]), a.dtype) for n, a in planes.items()}


def merge_rounds(rounds: list) -> tuple[tuple, list, int]:
    """A step's rounds as the fill takes them: ``(layers, rounds, most)``, the layers in order, one round per layer
    (a layer's several rounds, the MTP layer's drafts, concatenated in order), their per-entry arrays padded to one
    width, and the most rounds one layer had. The gathered rows (``packed``) keep each layer's own width: the fill's
    row copy takes them so, and padding them would copy every gathered row of the layer."""
    by_layer: dict[int, list] = {}
    for r in rounds:
        by_layer.setdefault(r.layer, []).append(r)
    layers = tuple(sorted(by_layer))
    merged = [_concat_rounds(by_layer[l]) for l in layers]
    M = max(r.pos.shape[1] for r in merged)
    return layers, [_pad_round(r, M) for r in merged], max(len(v) for v in by_layer.values())


def trace_rounds(rounds: list, step) -> dict:
    """What a selection trace keeps of a step (``glm53.trace``): the positions each layer's round looked up
    (``pos``, ``valid``, ``in_ring``: served by the ring, so neither hit nor miss) exactly as the fill takes them,
    every lane's activity and first position. ``{}`` for a step without fill rounds."""
    rounds = [r for r in (rounds or ()) if r is not None]
    if not rounds or not step.fill:
        return {}
    layers, merged, _ = merge_rounds(rounds)
    return {"layers": jnp.asarray(layers, jnp.int32), "pos": jnp.stack([r.pos for r in merged]),
            "valid": jnp.stack([r.valid for r in merged]), "in_ring": jnp.stack([r.source == RING for r in merged]),
            "active": step.lanes.active, "start": step.positions[:, 0]}


def _concat_rounds(rs: list) -> Round:
    if len(rs) == 1:
        return rs[0]
    return Round(pos=jnp.concatenate([r.pos for r in rs], 1), source=jnp.concatenate([r.source for r in rs], 1),
                 slot=jnp.concatenate([r.slot for r in rs], 1), valid=jnp.concatenate([r.valid for r in rs], 1),
                 packed={n: jnp.concatenate([r.packed[n] for r in rs], 1) for n in rs[0].packed}, layer=rs[0].layer)


def _pad_round(r: Round, M: int) -> Round:
    """Pad entries that are no lookup at all: ring source, not valid (never counted, pinned or filled). The
    gathered rows stay as they are (the fill never reads a padded entry's row)."""
    pad = M - r.pos.shape[1]
    if not pad:
        return r
    p2 = lambda a, v: jnp.pad(a, ((0, 0), (0, pad)), constant_values=v)
    return r.replace(pos=p2(r.pos, 0), source=p2(r.source, RING), slot=p2(r.slot, -1), valid=p2(r.valid, False))


# ----------------------------------------------------------------------------------------------------------------
# Sizes and construction
# ----------------------------------------------------------------------------------------------------------------
def ring_rows_for(cc: CacheConfig) -> int:
    """The ring holds every row not yet in host memory. After a step's copyback (at its start) that is at most a
    page: the rows past the last complete page, and the one row the MTP layer lags; the step then adds its rows (a
    prefill chunk, or a verify step's T <= 4 rows and the drafts' MTP rows after them, < 8). A power of two, so
    ``p % R`` is cheap and pages never wrap inside the ring."""
    need = max(cc.ring_rows, 2 * cc.copyback_every, cc.copyback_every + max(cc.prefill_chunk, 2 * MAX_VERIFY_ROWS))
    return 1 << (need - 1).bit_length()


def copy_after_write(page_rows: int, ring_rows: int, step_rows: int) -> bool:
    """Whether a step of ``step_rows`` rows per lane can copy back after layer 0's ring write (``begin_step``): at
    that write the ring holds the rows the copy takes (under a page past the last copied page, the one row the MTP
    layer lags, the previous step's rows) and this step's. A step follows a step of at most as many rows, or a
    settle (the engine settles after every prefill, append and generate); decode and verify steps write at most
    ``2 * MAX_VERIFY_ROWS`` rows (the verify rows and the drafts' MTP rows)."""
    rows = max(step_rows, 2 * MAX_VERIFY_ROWS)
    return page_rows + 2 * rows <= ring_rows


def copy_pages_for(cc: CacheConfig, tokens: int) -> int:
    """Pages that can be due at the start of a step that follows steps of ``tokens`` rows each."""
    return -(-(tokens + 1) // cc.copyback_every) + 1


def min_hot_rows(cfg: ModelConfig, cc: CacheConfig) -> int:
    """The smallest hot cache that can work: one decode round can pin every selected row (index_topk), and the
    recent ring's rows must be placeable once copied back."""
    return cfg.index_topk + ring_rows_for(cc)


def hot_rows_for(cfg: ModelConfig, cc: CacheConfig, capacity: int) -> int:
    """The hot-cache rows an engine of ``capacity`` rows per slot allocates: ``cc.hot_rows``, cut to the slot's rows
    (a power of two, at least what a round pins) when larger: a hot cache with more rows than a slot's history could
    never fill. ``Engine`` and the capacity accounting (``glm53.memory``) both take it from here."""
    fits = 1 << (max(capacity, min_hot_rows(cfg, cc)) - 1).bit_length()
    return min(cc.hot_rows, fits)


def slot_map_dtype(hot_rows: int) -> np.dtype:
    """``slot_of_position``'s dtype, chosen here only: int16 when every slot (< hot_rows) and the -1 sentinel fit,
    i.e. ``hot_rows <= 32,768`` (the design's 2 bytes per position: 18 MB instead of 36 MB for 9 layers of a
    1M-row slot), else int32."""
    return np.dtype(np.int16) if hot_rows <= np.iinfo(np.int16).max + 1 else np.dtype(np.int32)


def ring_shapes(cfg: ModelConfig, cc: CacheConfig, slots: int) -> dict:
    """``{plane: (shape, dtype)}`` of the ring: flat ``[L * slots * R + pad, W]`` (``addressable_planes``)."""
    return addressable_planes(kv_formats.get_format(cc.kv_format), cfg.num_cache_layers * slots * ring_rows_for(cc))


def hot_shapes(cfg: ModelConfig, cc: CacheConfig, slots: int) -> dict:
    """``{plane: (shape, dtype)}`` of the hot cache: flat ``[L * slots * H + pad, W]``: at the H200 target (9 layers x
    16 slots x 32,768 rows, q8g64) the int8 latent plane's 2.4G elements would be misaddressed, so it alone gets
    3.7M padding rows (+1.9 GB) where phantom slots added 13 slots of every per-slot array (+18.5 GB)."""
    return addressable_planes(kv_formats.get_format(cc.kv_format), cfg.num_cache_layers * slots * cc.hot_rows)


def indexed_rows(cfg: ModelConfig, cc: CacheConfig, slots: int, capacity: int, pool_pages: int) -> dict:
    """``{array: (rows, how they are counted)}`` of the flat arrays an offload step indexes with int32 rows."""
    L, P, H, R = cfg.num_cache_layers, cc.copyback_every, cc.hot_rows, ring_rows_for(cc)
    pages = max(pool_pages, 1)
    return {
        "host pool": (pages * L * P, f"{pages:,} pages x {L} layers x {P} rows per page"),
        "slot_of_position": (L * slots * capacity, f"{L} layers x {slots} slots x {capacity:,} rows per slot"),
        "hot cache": (L * slots * H, f"{L} layers x {slots} slots x {H:,} hot rows"),
        "ring": (L * slots * R, f"{L} layers x {slots} slots x {R:,} ring rows"),
    }


def validate(cfg: ModelConfig, cc: CacheConfig, slots: int | None = None, capacity: int | None = None,
             pool_pages: int | None = None) -> None:
    """Refuse a configuration the offload cache cannot run; with ``slots``, ``capacity`` and ``pool_pages``, also
    sizes whose arrays would outgrow int32 row indices (see the module doc)."""
    if slots is not None:
        for what, (rows, how) in indexed_rows(cfg, cc, slots, capacity, pool_pages).items():
            if rows > MAX_PLANE_ROWS:  # the step's flat int32 indices and the kernels' one-past-the-end rows
                raise ConfigError(f"offload: the {what} would hold {rows:,} rows ({how}), more than int32 row "
                                  f"indices reach ({MAX_PLANE_ROWS:,}); lower the sessions, max_len or "
                                  "host_budget_bytes")
    need = min_hot_rows(cfg, cc)
    if cc.hot_rows < need:
        raise ConfigError(f"offload: hot_rows={cc.hot_rows} is below what a round can pin: index_topk="
                          f"{cfg.index_topk} selected rows + {ring_rows_for(cc)} ring rows = {need}; raise hot_rows "
                          f"to {1 << (need - 1).bit_length()} (a power of two), or shrink the ring: it holds the rows "
                          f"not yet in host memory, at least copyback_every ({cc.copyback_every}) + prefill_chunk "
                          f"({cc.prefill_chunk}) rounded up to a power of two "
                          f"(ring_rows={cc.ring_rows or 'automatic'})")
    if cc.hot_rows & (cc.hot_rows - 1):
        raise ConfigError(f"offload: hot_rows={cc.hot_rows} must be a power of two")


# Pools larger than this show a progress bar while they are allocated.
POOL_PROGRESS_BYTES = 1 << 30
# XLA's GPU client allocates pinned_host buffers from one BFC allocator, "xla_gpu_host_bfc", capped at this many GiB
# unless the variable says otherwise when the backend starts (GetGpuHostAllocator in xla/pjrt/gpu/gpu_helpers.cc).
PINNED_HOST_LIMIT_VAR, PINNED_HOST_LIMIT_DEFAULT_GIB = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", 64


def _host_zeros(shape: tuple, dtype, host: jax.sharding.Sharding) -> Array:
    """A zero ``pinned_host`` array, built without a second host-sized buffer and without device memory:
    ``device_put`` of ``np.zeros``.

    NumPy's zeros come from calloc, so the source's pages are never made resident (reading untouched anonymous
    memory maps the kernel's zero page). jaxlib hands NumPy arrays to PJRT zero-copy (``kImmutableZeroCopy``:
    jaxlib/py_values.cc ``HandleNumpyArray``), and PJRT's GPU client allocates the destination in the pinned host
    memory space and copies into it straight from the NumPy buffer, through a pinned staging buffer only below 1 GiB
    (xla/pjrt/pjrt_stream_executor_client.cc ``LinearizeHostBufferInto``, ``ShouldStageHostToDeviceTransfers``).

    Rejected: a jitted ``jnp.zeros`` with pinned_host ``out_shardings``. On GPUs XLA computes the zeros in device
    memory and copies them out (its HostOffloader adds a copy to host for an entry result moved to host:
    xla/hlo/transforms/host_offloader.cc ``HandleMoveToHostCustomCall``), a device buffer as large as the plane. On
    the CPU backend it is no faster, and the offload step that donated such a pool aborted the process (JAX 0.10.2:
    "PjRtBuffer's memory kind does not match sharding's memory kind").

    Measured by ``experiments/probe_pool_alloc.py`` (a 2 GiB q8g64 pool, CPU backend, 2 cores): this way one plane
    at a time 0.90 s, all planes at once 0.76 s, the jitted zeros 0.77 s; peak RSS the pool plus the 0.2 GiB
    baseline in every case (no second host-sized copy).

    On the H200 (125 GiB machine) a 16 x 1M-token pool (92.3 GiB) was killed for host memory while its 77 GB latent
    plane was allocated, with ``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=118``, both this way and as device zeros moved to
    pinned memory; with the cap at 96 the device-zeros way ran (45 s for the pool, RSS 105 GiB after it). So the
    cap, not the copy, is the likely cause (XLA's pinned allocator may take more than the request; this way with
    the lower cap was not tried). On GPUs the plane is made as device zeros and moved to pinned host memory (a
    device-to-host DMA into the pinned buffer; the device buffer is transient and freed) when the device has room
    for it, the way that is known to work at this size; otherwise as above."""
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    device = next(iter(host.device_set))
    if device.platform in ops.GPU_BACKENDS:
        stats = device.memory_stats() or {}
        free = stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0)
        if free > size + (1 << 30):
            zeros = jnp.zeros(shape, dtype, device=device)
            out = jax.device_put(zeros, host)
            out.block_until_ready()
            zeros.delete()
            return out
    return jax.device_put(np.zeros(shape, dtype), host)


def allocate_pool(fmt: kv_formats.KVFormat, rows: int, device, progress_min_bytes: int = POOL_PROGRESS_BYTES,
                  mesh=None) -> dict:
    """The host pool's planes ``{plane: [rows, W]}``, zero, in ``pinned_host`` memory: allocated once, one plane at a
    time, with a progress bar over the bytes when the pool is larger than ``progress_min_bytes``. One at a time
    bounds what is in flight (PJRT stages planes under 1 GiB through pinned buffers taken from the same capped
    allocator as the pool) and lets the bar move; it costs little (0.14 s of 0.9 s for 2 GiB on the CPU backend). On
    GPUs a pool larger than XLA's pinned host allocator is refused up front, with the variable that raises it,
    instead of failing halfway through. On a ``mesh`` the pool is replicated: every device of it holds the whole
    pool in its host memory (``glm53.sharding``: the owner / peer split is not built yet)."""
    if mesh is not None:
        host = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(), memory_kind="pinned_host")
    else:
        host = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    shapes = fmt.plane_shapes(rows)
    sizes = {n: int(np.prod(shape)) * np.dtype(dt).itemsize for n, (shape, dt) in shapes.items()}
    total = sum(sizes.values())
    if device.platform in ops.GPU_BACKENDS:
        limit_gib = int(os.environ.get(PINNED_HOST_LIMIT_VAR, PINNED_HOST_LIMIT_DEFAULT_GIB))
        if total > limit_gib << 30:
            raise ConfigError(f"offload: the host pool needs {total / 2**30:.1f} GiB of pinned host memory, more than "
                              f"XLA's pinned host allocator holds ({limit_gib} GiB): set {PINNED_HOST_LIMIT_VAR} above "
                              "the pool (with a few GiB for transfer staging) before JAX starts, or lower "
                              "host_budget_bytes")
    pool = {}
    with tqdm.tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="host pool",
                   disable=total <= progress_min_bytes) as bar:
        for name, (shape, dt) in shapes.items():
            bar.set_postfix_str(f"{name} {np.dtype(dt).name}{list(shape)}")
            pool[name] = _host_zeros(shape, dt, host).block_until_ready()
            bar.update(sizes[name])
    return pool


def page_bytes(cfg: ModelConfig, cc: CacheConfig) -> int:
    """Host bytes of one pool page: ``copyback_every`` rows of every cache layer."""
    return cc.copyback_every * cfg.num_cache_layers * kv_formats.get_format(cc.kv_format).bytes_per_row


def pool_rows(cfg: ModelConfig, cc: CacheConfig, pool_pages: int) -> int:
    """Rows of each host pool plane for ``pool_pages`` pages (at least one page: the pool is never empty)."""
    return max(pool_pages, 1) * cfg.num_cache_layers * cc.copyback_every


def init_offload(cfg: ModelConfig, cc: CacheConfig, slots: int, capacity: int, pool_pages: int, dtype,
                 device=None, mesh=None, pool: dict | None = None) -> OffloadCache:
    """An empty offload cache: ``slots`` session slots of ``capacity`` rows, a host pool of ``pool_pages`` pages
    (allocated once, in pinned_host memory). ``pool``: planes to use instead of allocating them (abstract ones,
    under ``jax.eval_shape``, for ``glm53.memory.compiled_step_memory``)."""
    validate(cfg, cc, slots, capacity, pool_pages)
    fmt = kv_formats.get_format(cc.kv_format)
    L, S, N = cfg.num_cache_layers, slots, capacity
    P, R, H = cc.copyback_every, ring_rows_for(cc), cc.hot_rows
    if N % P:
        raise ConfigError(f"capacity {N} must be a multiple of copyback_every={P}")
    device = device or jax.local_devices()[0]  # this process's first (several processes: not the global first)
    if pool is None:
        pool = allocate_pool(fmt, pool_rows(cfg, cc, pool_pages), device, mesh=mesh)
    cache = OffloadCache(
        sessions=init_sessions(cfg, S), **init_index_keys(cfg, cc, S, N, dtype), pool=pool,
        page_table=jnp.full((S, N // P), -1, jnp.int32), host_len=jnp.zeros((S,), jnp.int32),
        ring={n: jnp.zeros(s, d) for n, (s, d) in ring_shapes(cfg, cc, S).items()},
        hot={n: jnp.zeros(s, d) for n, (s, d) in hot_shapes(cfg, cc, S).items()},
        slot_of_position=jnp.full((L, S, N), -1, slot_map_dtype(H)),
        position_of_slot=jnp.full((L, S, H), -1, jnp.int32),
        pin_round=jnp.full((L, S, H), -1, jnp.int32), rounds=jnp.zeros((L, S), jnp.int32),
        clock=jnp.zeros((L, S), jnp.int32), counters=jnp.zeros((L, S, len(COUNTERS)), jnp.int32),
        bulk_pages=jnp.zeros((L, S), jnp.int32), copybacks=jnp.zeros((S,), jnp.int32),
        unassigned=jnp.zeros((S,), jnp.int32),
        policy_state={n: jnp.zeros((L, S, H), jnp.int32) for n in POLICY_STATE[cc.policy]},
        kv_format=fmt.name, indexer_precision=cc.indexer_precision, policy=cc.policy,
        key_slot_of_layer=key_slots(cfg),
        _has_mtp_layer=bool(cfg.num_nextn_predict_layers), _holds_mtp_layer=cfg.cache_holds_mtp_layer,
        page_rows=P, _ring_rows=R)
    return place(cache, device, mesh)


# ----------------------------------------------------------------------------------------------------------------
# Stats
# ----------------------------------------------------------------------------------------------------------------
def lookup_stats(counters, row_bytes: int) -> dict:
    """Totals of one session's lookup counters ``[L, C]`` (``COUNTERS``): hits, misses, ring reads, fills,
    evictions, the hit rate (None without lookups) and the bytes the misses read from host memory."""
    c = np.asarray(counters, np.int64)
    hits, misses = int(c[:, 0].sum()), int(c[:, 1].sum())
    return {"hits": hits, "misses": misses, "ring_reads": int(c[:, 2].sum()), "fills": int(c[:, 3].sum()),
            "evictions": int(c[:, 4].sum()), "hit_rate": hits / (hits + misses) if hits + misses else None,
            "bytes_from_host": misses * row_bytes}


def slot_stats(cache: OffloadCache, slot: int, counters=None, bulk=None, copybacks=None) -> dict:
    """Per-layer counters of one slot and the bytes moved, as plain Python numbers. Arrays already fetched to the
    host can be passed in (``counters [L, S, C]``, ``bulk`` = ``bulk_pages [L, S]`` etc.) to avoid another device
    read. Bulk reads are counted in pages on the device and converted to rows and bytes here, in int64."""
    c = np.asarray(cache.counters if counters is None else counters)[:, slot].astype(np.int64)  # [L, C]
    bulk_pages = np.asarray(cache.bulk_pages if bulk is None else bulk)[:, slot].astype(np.int64)
    bulk = bulk_pages * cache.page_rows  # rows, in int64
    pages = int(np.asarray(cache.copybacks if copybacks is None else copybacks)[slot])
    row_bytes = cache.fmt.bytes_per_row
    per = {name: c[:, i].tolist() for i, name in enumerate(COUNTERS)}
    lookups = c[:, 0] + c[:, 1]
    # A layer that looked nothing up has no hit rate (not 1.0): None.
    per["hit_rate"] = [float(h / n) if n else None for h, n in zip(c[:, 0], lookups)]
    per["bulk_pages"] = bulk_pages.tolist()
    per["bulk_rows"] = bulk.tolist()
    totals = lookup_stats(c, row_bytes)
    return {
        "per_layer": per, "hit_rate": totals["hit_rate"], **totals, "bulk_bytes_from_host": int(bulk.sum() * row_bytes),
        "copybacks": pages, "bytes_to_host": int(pages * cache.page_rows * cache.num_layers * row_bytes),
    }
