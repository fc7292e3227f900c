"""The KV cache as data: one pytree passed into and returned from every jitted step (and donated).

Two implementations of one interface: ``ResidentCache`` (below: every row on the accelerator) and
``glm53.offload.OffloadCache`` (history in host memory, a hot cache on the accelerator). The engine chooses one
where it builds the cache; the model and the steps only call the interface, so they never see a mode:

    begin_step(step)                          work due before a step reads anything (offload: page copyback)
    write_rows(layer, latent, rope, step)     store a step's new MLA rows (packed into kv_format here, once)
    write_index_keys(layer, keys, step)       store a step's new DSA indexer keys
    index_keys_for(layer, step)               (key planes, plane of each lane) for the indexer kernel
    gather_rows(layer, selected, valid, step) the rows a step's tokens attend to -> (latent, rope, cache, round)
    finish_step(rounds, step)                 work after every layer has read (offload: the batched hot fill)
    clear_slot / copy_slot / truncate_slot    session lifecycle between steps (open, fork, rollback)

Layout (S session slots, L cache layers = main layers + MTP layer, N rows per slot, B lanes in a step):

    sessions.lengths      int32[S]     rows of history in the cache (main layers)
    sessions.mtp_lengths  int32[S]     rows the MTP layer holds: it runs one position behind (its row i pairs the
                                       hidden state at i with the token at i + 1, which exists one step later)
    sessions.hidden       f32[S, Hd]   final-normed hidden state at position lengths - 1 (the MTP module's input
                                       and the logits of the next token), exactly the model dtype's values
    index_keys            [Lf, S + pad, N, D] DSA indexer keys of the layers with a "full" indexer, in the model
                                       dtype or (``CacheConfig.index_keys="fp8"``) float8_e4m3fn, stored as bits
                                       (bf16 as uint16, e4m3 as uint8: ``kv_formats.stored_dtype``) ...
    index_key_scale       f32[Lf, S + pad, N] ... with one scale per key (None for model-dtype keys); ``pad`` key
                                       slots (none unless fp8 keys need them, ``index_key_shapes``) are never read
    resident history      {plane: [L * S + pad, N, W]} MLA rows as kv_format planes (kernels_pallas.kv_formats,
                                       stored as bits like the keys):
                                       the N rows of layer l, slot s are plane l * S + s; ``pad`` planes (none
                                       unless a 1-byte plane needs them, ``addressable_planes``) are never used

A step works on B *lanes*; lane b is slot ``lanes.slot[b]``. Inactive lanes are padding (batches are bucketed to a
few sizes) and must change nothing: every per-slot write goes through ``Lanes.write_slot``, which sends inactive
lanes to the out-of-range index S, and scatters run with ``mode="drop"``.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from glm53.config import CacheConfig, ModelConfig, round_up
from kernels_pallas import indexer_topk, kv_formats, ops
from kernels_pallas.hot_gather import triton_misaddressed

Array = jax.Array


@flax.struct.dataclass
class Lanes:
    slot: Array  # int32[B]: the session slot each lane of a step works on
    active: Array  # bool[B]: inactive lanes are padding and write nothing

    @property
    def size(self) -> int:
        return int(self.slot.shape[0])

    def write_slot(self, num_slots: int) -> Array:
        """Slot index for per-slot scatters: inactive lanes point past the end (dropped)."""
        return jnp.where(self.active, self.slot, num_slots)


@flax.struct.dataclass
class Sessions:
    lengths: Array  # int32[S]
    mtp_lengths: Array  # int32[S]
    hidden: Array  # f32[S, Hd]


@flax.struct.dataclass
class Round:
    """One layer's reads of one step (offload): what the fill at the end of the step needs. Resident: None."""
    pos: Array  # int32[B, M] selected positions
    source: Array  # int32[B, M] ring / hot / host
    slot: Array  # int32[B, M] hot slot of hits
    valid: Array  # bool[B, M] entries attention uses
    packed: dict  # plane -> [B, M, W] the rows as stored, at misses (what the fill copies into victim slots)
    layer: int = flax.struct.field(pytree_node=False, default=0)


class CacheBase:
    """What both cache types share: sessions, indexer keys, lane bookkeeping. Subclasses are flax dataclasses
    with the fields ``sessions``, ``index_keys``, ``index_key_scale``, ``kv_format``, ``indexer_precision`` and
    ``key_slot_of_layer``."""

    sessions: Sessions
    index_keys: Array
    index_key_scale: Array | None
    kv_format: str
    indexer_precision: str
    key_slot_of_layer: tuple

    @property
    def num_slots(self) -> int:
        return int(self.sessions.lengths.shape[0])

    @property
    def index_key_slots(self) -> int:
        """Slots of ``index_keys``: ``num_slots`` and the padding slots that keep fp8 keys addressable."""
        return int(self.index_keys.shape[1])

    @property
    def capacity(self) -> int:
        return int(self.index_keys.shape[2])

    @property
    def num_layers(self) -> int:
        return len(self.key_slot_of_layer)

    @property
    def index_key_dtype(self) -> np.dtype:
        """The dtype of the indexer keys' values (``index_keys`` holds their bits)."""
        return index_key_values(self.index_keys.dtype)

    @property
    def fmt(self) -> kv_formats.KVFormat:
        return kv_formats.get_format(self.kv_format)

    # ---- inside a step ----
    def write_index_keys(self, layer: int, keys: Array, step) -> "CacheBase":
        """``keys [B, T, D]`` of one layer at ``step.write_positions`` (padding and inactive lanes dropped)."""
        ks = self.key_slot_of_layer[layer]
        assert ks >= 0, f"layer {layer} has a shared indexer and caches no keys"
        slot = step.lanes.write_slot(self.index_key_slots)  # inactive lanes past the padding slots too: dropped
        where = (ks, slot[:, None], step.write_positions)
        if self.index_key_scale is None:
            bits = kv_formats.to_stored(keys.astype(self.index_key_dtype))
            return self.replace(index_keys=self.index_keys.at[where].set(bits, mode="drop"))
        # Quantised once, where the key is written: every later read (any mode, any step) sees the same bytes.
        k8, scale = indexer_topk.quantize_index_keys(keys)
        return self.replace(index_keys=self.index_keys.at[where].set(kv_formats.to_stored(k8), mode="drop"),
                            index_key_scale=self.index_key_scale.at[where].set(scale, mode="drop"))

    def index_keys_for(self, layer: int, step) -> tuple[Array, Array | None, Array]:
        """All key planes ``[Lf * S, N, D]`` (a free reshape: slicing one layer or slot out would copy it), their
        scales ``[Lf * S, N]`` (fp8 keys; else None) and the plane of each lane."""
        ks = self.key_slot_of_layer[layer]
        planes = self.index_keys.reshape(-1, *self.index_keys.shape[2:])
        scales = None if self.index_key_scale is None else self.index_key_scale.reshape(-1, self.capacity)
        return planes, scales, (ks * self.index_key_slots + step.lanes.slot).astype(jnp.int32)

    def with_sessions(self, **kw) -> "CacheBase":
        return self.replace(sessions=self.sessions.replace(**kw))

    def advance(self, step, n_commit: Array, hidden_last: Array, mtp_end: Array | None) -> "CacheBase":
        """After a step: ``n_commit [B]`` rows of each lane are final; ``hidden_last [B, Hd]`` is the hidden state
        of the last of them; the MTP layer holds rows below ``mtp_end [B]`` (None: no MTP layer)."""
        S = self.num_slots
        slot = jnp.where(step.lanes.active & (n_commit > 0), step.lanes.slot, S)
        s = self.sessions
        lengths = s.lengths.at[slot].add(n_commit.astype(jnp.int32), mode="drop")
        hidden = s.hidden.at[slot].set(hidden_last.astype(s.hidden.dtype), mode="drop")
        mtp_lengths = s.mtp_lengths
        if mtp_end is not None:
            mtp_lengths = mtp_lengths.at[slot].max(mtp_end.astype(jnp.int32), mode="drop")
        return self.with_sessions(lengths=lengths, hidden=hidden, mtp_lengths=mtp_lengths)

    def committed(self) -> Array:
        """int32[S]: rows final in every layer (the MTP layer lags the main layers by one)."""
        if self._has_mtp_layer:
            return jnp.minimum(self.sessions.lengths, self.sessions.mtp_lengths)
        return self.sessions.lengths

    # ---- between steps: session lifecycle (each jitted by glm53.steps with the cache donated) ----
    def _clear_common(self, slot: Array) -> dict:
        s = self.sessions
        return dict(sessions=Sessions(lengths=s.lengths.at[slot].set(0), mtp_lengths=s.mtp_lengths.at[slot].set(0),
                                      hidden=s.hidden.at[slot].set(0.0)))

    def _copy_common(self, src: Array, dst: Array) -> dict:
        s = self.sessions
        return dict(sessions=Sessions(lengths=s.lengths.at[dst].set(s.lengths[src]),
                                      mtp_lengths=s.mtp_lengths.at[dst].set(s.mtp_lengths[src]),
                                      hidden=s.hidden.at[dst].set(s.hidden[src])),
                    index_keys=self.index_keys.at[:, dst].set(self.index_keys[:, src]),
                    index_key_scale=(None if self.index_key_scale is None
                                     else self.index_key_scale.at[:, dst].set(self.index_key_scale[:, src])))

    def _truncate_common(self, slot: Array, length: Array, mtp_length: Array) -> dict:
        s = self.sessions
        return dict(sessions=s.replace(lengths=s.lengths.at[slot].set(length),
                                       mtp_lengths=s.mtp_lengths.at[slot].set(mtp_length)))

    def nbytes(self) -> dict[str, int]:
        """Bytes of every array the cache holds, by part and memory kind (allocation, not logical length)."""
        out: dict[str, int] = {}
        for path, leaf in jax.tree_util.tree_leaves_with_path(self):
            part = str(getattr(path[0], "name", path[0]))
            out[part] = out.get(part, 0) + int(leaf.nbytes)
        return out


@flax.struct.dataclass
class ResidentCache(CacheBase):
    """Every row of every session on the accelerator: the baseline offload must match bit for bit."""

    sessions: Sessions
    index_keys: Array
    index_key_scale: Array | None
    history: dict  # plane -> [L * S + pad, N, W]: layer l, slot s at plane l * S + s (pad: addressable_planes)
    kv_format: str = flax.struct.field(pytree_node=False, default="bf16")
    indexer_precision: str = flax.struct.field(pytree_node=False, default="highest")
    key_slot_of_layer: tuple = flax.struct.field(pytree_node=False, default=())
    _has_mtp_layer: bool = flax.struct.field(pytree_node=False, default=False)

    mode = "resident"

    def begin_step(self, step) -> "ResidentCache":
        return self

    def write_rows(self, layer: int, latent: Array, rope: Array, step) -> "ResidentCache":
        """Rows are packed into kv_format here, once, so every later read (resident, hit, miss or ring) sees the
        same bytes: that is what makes offload bit-identical to resident."""
        with jax.named_scope("resident_write"):
            planes = kv_formats.pack(self.fmt, latent, rope)
            # Inactive lanes go past the last plane (padding planes included): dropped, like padding positions.
            plane = layer * self.num_slots + step.lanes.slot
            history = {n: h.at[jnp.where(step.lanes.active, plane, h.shape[0])[:, None], step.write_positions]
                       .set(planes[n].astype(h.dtype), mode="drop")
                       for n, h in self.history.items()}
        return self.replace(history=history)

    def gather_rows(self, layer: int, selected: Array, valid: Array, step, dtype):
        """Dequantised rows at ``selected [B, T, K]``: ``(latent [B,T,K,512], rope [B,T,K,64], cache, None)``."""
        del valid
        B, T, K = selected.shape
        # All layers' and slots' planes [L*S + pad, N, W] as they are stored and each lane's plane: slicing out a
        # layer would make XLA copy its whole history before the kernel, on every layer of every step.
        planes = self.history
        plane_of_lane = (layer * self.num_slots + step.lanes.slot).astype(jnp.int32)
        with jax.named_scope("resident_gather"):
            latent, rope = ops.gather_rows(planes, plane_of_lane, selected.reshape(B, T * K),
                                           kv_format=self.kv_format, out_dtype=dtype, impl=step.kernels)
        return latent.reshape(B, T, K, -1), rope.reshape(B, T, K, -1), self, None

    def finish_step(self, rounds, step) -> "ResidentCache":
        return self

    # ---- lifecycle ----
    def clear_slot(self, slot: Array) -> "ResidentCache":
        return self.replace(**self._clear_common(slot))

    def _slot_planes(self, slot: Array) -> Array:
        """int32[L]: the history planes of one slot, one per layer."""
        return jnp.arange(self.num_layers, dtype=jnp.int32) * self.num_slots + slot

    def history_planes(self) -> dict:
        """The history as ``{plane: [L, S, N, W]}`` (padding planes dropped; a copy, for inspection and tests)."""
        L, S = self.num_layers, self.num_slots
        return {n: h[:L * S].reshape(L, S, *h.shape[1:]) for n, h in self.history.items()}

    def copy_slot(self, src: Array, dst: Array) -> "ResidentCache":
        history = {n: h.at[self._slot_planes(dst)].set(h[self._slot_planes(src)]) for n, h in self.history.items()}
        return self.replace(history=history, **self._copy_common(src, dst))

    def truncate_slot(self, slot: Array, length: Array, mtp_length: Array, kernels: str) -> "ResidentCache":
        """Rollback: rows at and past the new lengths are simply beyond them (causal masks never reach them, and
        the next step overwrites them)."""
        del kernels
        return self.replace(**self._truncate_common(slot, length, mtp_length))

    def read_slot_rows(self, slot: Array, kernels: str) -> dict:
        """Every row of one slot, ``{plane: [L, N, W]}`` on the device (for save)."""
        del kernels
        return {n: h[self._slot_planes(slot)] for n, h in self.history.items()}

    def write_slot_rows(self, slot: Array, rows: dict, length: Array, mtp_length: Array, kernels: str):
        """Restore: rows ``{plane: [L, N, W]}`` (valid below the lengths) into a cleared slot."""
        del kernels
        history = {n: h.at[self._slot_planes(slot)].set(rows[n].astype(h.dtype)) for n, h in self.history.items()}
        return self.replace(history=history)


def capacity_for(rows: int, cache_config: CacheConfig) -> int:
    """Rows per slot to allocate for ``rows`` positions: whole pages, and a multiple of the indexer kernel's
    128-key blocks (both powers of two)."""
    return round_up(max(rows, 1), max(cache_config.copyback_every, 128))


def padded_rows(rows: int, row_shape: tuple, dtype) -> int:
    """Rows to allocate for an array ``[rows, *row_shape]`` of ``dtype`` so Pallas' Triton lowering addresses it
    right: ``rows`` itself, unless the array would hold 2**31 or more elements in at most 2**32 bytes (1-byte
    dtypes: int8 / fp8 latent planes; of wider ones only exactly 2**31 2-byte elements), which the lowering
    addresses with 32-bit offsets that wrap negative (``kernels_pallas.hot_gather``, "Addressing") and the compiled
    kernels refuse (``check_addressable``); then just enough rows to pass 2**32 bytes, into its 64-bit regime. The
    rows past ``rows`` are padding that nothing addresses."""
    if not triton_misaddressed((rows, *row_shape), dtype):
        return rows
    return 2**32 // (int(np.prod(row_shape, dtype=np.int64)) * np.dtype(dtype).itemsize) + 1


def addressable_planes(fmt: kv_formats.KVFormat, rows: int, *inner: int, uniform: bool = False) -> dict:
    """``{plane: (shape, dtype)}`` of the kv_format planes ``[rows + pad, *inner, W]`` holding ``rows`` used rows
    (or planes of ``inner`` rows), each padded as ``padded_rows`` says: only a plane that would be misaddressed
    grows, and only by rows, never by session slots. ``uniform``: one row count for every plane (the largest any
    needs), for kernels that take planes of one shape (``gather_rows``). The padding rows sit past every row a
    slot addresses, so nothing reads or writes them; ``glm53.memory.cache_bytes`` counts them."""
    shapes = fmt.plane_shapes(rows, *inner)
    padded = {n: padded_rows(rows, shape[1:], dt) for n, (shape, dt) in shapes.items()}
    if uniform:
        r = max(padded.values())
        while any(triton_misaddressed((r, *shape[1:]), dt) for shape, dt in shapes.values()):
            r = max(padded_rows(r, shape[1:], dt) for shape, dt in shapes.values())
        padded = dict.fromkeys(shapes, r)
    return {n: ((padded[n], *shape[1:]), dt) for n, (shape, dt) in shapes.items()}


def key_slots(cfg: ModelConfig) -> tuple[int, ...]:
    """Cache layer -> row of index_keys (-1 for layers whose indexer is "shared")."""
    full = cfg.full_indexer_layers
    return tuple(full.index(l) if l in full else -1 for l in range(cfg.num_cache_layers))


def init_sessions(cfg: ModelConfig, slots: int) -> Sessions:
    return Sessions(lengths=jnp.zeros((slots,), jnp.int32), mtp_lengths=jnp.zeros((slots,), jnp.int32),
                    hidden=jnp.zeros((slots, cfg.hidden_size), jnp.float32))


# The keys' values by the dtype storing them (``kv_formats.stored_dtype``): the model's dtype is float32 or bfloat16
# (glm53.params), fp8 keys are e4m3, so each stored dtype stores one kind of value.
_INDEX_KEY_VALUES = {np.dtype(np.uint16): np.dtype(jnp.bfloat16), np.dtype(np.uint8): np.dtype(jnp.float8_e4m3fn)}


def index_key_values(stored) -> np.dtype:
    """The dtype of the indexer keys' values that a cache stores as ``stored``."""
    return _INDEX_KEY_VALUES.get(np.dtype(stored), np.dtype(stored))


def index_key_shapes(cfg: ModelConfig, cc: CacheConfig, slots: int, capacity: int, dtype) -> dict:
    """``{"index_keys": (shape, dtype), "index_key_scale": (shape, dtype) or None}``: ``[Lf, S + pad, N, D]`` keys
    (their bits: ``kv_formats.stored_dtype`` of the model dtype or of e4m3) and ``[Lf, S + pad, N]`` scales. The
    indexer kernel reads the keys in place as planes ``[Lf * (S + pad), N, D]``; fp8 keys of 2**31..2**32 one-byte
    elements (e.g. 5 layers x 4 slots x 1M positions x 128) are addressed with 32-bit offsets that wrap negative
    (``kernels_pallas.hot_gather``, "Addressing"), so ``pad`` key slots, never written or read, take them past 2**32
    bytes, as ``addressable_planes`` does for the history. Slots, not positions: padding positions could be selected
    by a lane with fewer live positions than top-k."""
    Lf, D = len(cfg.full_indexer_layers), cfg.index_head_dim
    key_dtype = jnp.dtype(jnp.float8_e4m3fn) if cc.index_keys == "fp8" else jnp.dtype(dtype)
    allocated = slots
    if Lf and triton_misaddressed((Lf * slots, capacity, D), key_dtype):
        allocated = -(-padded_rows(Lf * slots, (capacity, D), key_dtype) // Lf)
    shape = (Lf, allocated, capacity)
    return {"index_keys": ((*shape, D), kv_formats.stored_dtype(key_dtype)),
            "index_key_scale": (shape, jnp.dtype(jnp.float32)) if cc.index_keys == "fp8" else None}


def init_index_keys(cfg: ModelConfig, cc: CacheConfig, slots: int, capacity: int, dtype) -> dict:
    """The ``index_keys`` and ``index_key_scale`` fields of a cache (zero keys, unit scales)."""
    shapes = index_key_shapes(cfg, cc, slots, capacity, dtype)
    scale = shapes["index_key_scale"]
    return dict(index_keys=jnp.zeros(*shapes["index_keys"]),
                index_key_scale=None if scale is None else jnp.ones(*scale))


def history_shapes(cfg: ModelConfig, cc: CacheConfig, slots: int, capacity: int) -> dict:
    """``{plane: (shape, dtype)}`` of the resident history: ``[L * slots + pad, capacity, W]``, one plane of
    ``capacity`` rows per layer and slot, and padding planes only where a 1-byte plane would be misaddressed
    (``addressable_planes``; uniform: ``gather_rows`` takes planes of one shape)."""
    fmt = kv_formats.get_format(cc.kv_format)
    return addressable_planes(fmt, cfg.num_cache_layers * slots, capacity, uniform=True)


def init_resident(cfg: ModelConfig, cc: CacheConfig, slots: int, capacity: int, dtype, device=None,
                  mesh=None) -> ResidentCache:
    fmt = kv_formats.get_format(cc.kv_format)
    history = {n: jnp.zeros(shape, dt) for n, (shape, dt) in history_shapes(cfg, cc, slots, capacity).items()}
    cache = ResidentCache(sessions=init_sessions(cfg, slots), **init_index_keys(cfg, cc, slots, capacity, dtype),
                          history=history, kv_format=fmt.name, indexer_precision=cc.indexer_precision,
                          key_slot_of_layer=key_slots(cfg), _has_mtp_layer=bool(cfg.num_nextn_predict_layers))
    return place(cache, device, mesh)


def place(tree, device=None, mesh=None):
    """Commit every array to the device (device memory), or replicate it over ``mesh`` (``glm53.sharding``: the
    cache is the same bytes on every device of a tensor-parallel group): a fresh cache and one returned by a step
    then share one jit signature, so nothing recompiles after the first step. Arrays already in pinned_host memory
    stay there."""
    device = device or jax.local_devices()[0]  # this process's first (several processes: not the global first)

    def put(x):
        kind = getattr(getattr(x, "sharding", None), "memory_kind", None) or "device"
        if mesh is not None:
            return jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(), memory_kind=kind))
        return jax.device_put(x, jax.sharding.SingleDeviceSharding(device, memory_kind=kind))

    return jax.tree_util.tree_map(put, tree)


def shardings(tree) -> Any:
    """The placement of every array of a pytree (a jitted step's ``out_shardings`` for the cache it returns)."""
    return jax.tree_util.tree_map(lambda x: x.sharding, tree)


def describe(cache) -> str:
    """A short human-readable summary of the cache pytree (shapes, dtypes, memory kinds)."""
    lines = [f"{type(cache).__name__}(kv_format={cache.kv_format}, slots={cache.num_slots}, "
             f"capacity={cache.capacity} rows, layers={cache.num_layers})"]

    def kind(a):
        return getattr(getattr(a, "sharding", None), "memory_kind", "?")

    for path, leaf in jax.tree_util.tree_leaves_with_path(cache):
        name = jax.tree_util.keystr(path)
        lines.append(f"  {name:<36} {str(leaf.dtype):<14} {str(tuple(leaf.shape)):<24} {kind(leaf)}")
    return "\n".join(lines)
