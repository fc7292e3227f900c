"""The KV cache as data: one pytree passed into and returned from every jitted step (and donated).

Layout (B sessions, L cache layers = main layers + MTP layers, N = capacity rows per session):

    lengths        int32[B]                 rows of history each session has (logical length)
    mtp_lengths    int32[B]                 rows the MTP layer has (it runs one position behind the main model)
    history[p]     resident: [L, B, N, W_p] on the accelerator; offload: the host page pool [pages*L*P, W_p] in
                   pinned_host memory. MLA rows as planes p in {"latent", "scale", "rope"} (kernels_pallas.kv_formats)
    index_keys     [Lf, B, N, index_dim]    DSA indexer keys, only for layers with a "full" indexer (always on the
                                            accelerator: every step scores all of them)
    offload        OffloadState | None      hot cache, slot maps, ring, counters (mode="offload"; glm53.offload)

The model never looks at the layout: it calls ``write_rows``, ``write_index_keys`` and ``gather_rows`` below, which
is where the two modes differ.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from kernels_pallas import kv_formats
from glm53.config import CacheConfig, ModelConfig, round_up


@flax.struct.dataclass
class KVCache:
    lengths: jax.Array
    mtp_lengths: jax.Array
    history: dict[str, jax.Array]
    index_keys: jax.Array
    offload: Any = None
    kv_format: str = flax.struct.field(pytree_node=False, default="bf16")
    mode: str = flax.struct.field(pytree_node=False, default="resident")
    # cache layer -> row of index_keys (-1 for layers whose indexer is "shared")
    key_slot_of_layer: tuple[int, ...] = flax.struct.field(pytree_node=False, default=())

    @property
    def batch(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def capacity(self) -> int:
        return int(self.index_keys.shape[2])

    @property
    def num_layers(self) -> int:
        return len(self.key_slot_of_layer)

    def nbytes(self) -> dict[str, int]:
        """Actual bytes of the arrays the cache holds, by part (allocation, not logical length)."""
        out = {"history": sum(int(a.nbytes) for a in self.history.values()),
               "index_keys": int(self.index_keys.nbytes)}
        if self.offload is not None:
            out.update(self.offload.nbytes())
        return out


def capacity_for(cache_config: CacheConfig, needed_rows: int) -> int:
    """Rows per session to allocate: ``max_len`` if set, else what the run needs, rounded up to whole pages."""
    rows = cache_config.max_len or needed_rows
    if rows < needed_rows:
        raise ValueError(f"cache.max_len={cache_config.max_len} rows cannot hold the {needed_rows} positions this "
                         "run needs (prompt + new tokens); raise cache.max_len or shorten the run")
    # Whole pages, and a multiple of the indexer kernel's 128-key blocks (both powers of two).
    return round_up(max(rows, 1), max(cache_config.page_size, 128))


def init_cache(cfg: ModelConfig, cache_config: CacheConfig, batch: int, capacity: int, dtype) -> KVCache:
    """An empty cache for ``batch`` sessions of ``capacity`` rows each (resident layout; offload converts it)."""
    fmt = kv_formats.get_format(cache_config.kv_format)
    L = cfg.num_cache_layers
    history = {name: jnp.zeros(shape, dt) for name, (shape, dt) in fmt.plane_shapes(L, batch, capacity).items()}
    full = cfg.full_indexer_layers
    slots = tuple(full.index(l) if l in full else -1 for l in range(L))
    index_keys = jnp.zeros((len(full), batch, capacity, cfg.index_head_dim), dtype)
    cache = KVCache(lengths=jnp.zeros((batch,), jnp.int32), mtp_lengths=jnp.zeros((batch,), jnp.int32),
                    history=history, index_keys=index_keys, kv_format=fmt.name, mode="resident",
                    key_slot_of_layer=slots)
    return commit(cache)


def commit(tree):
    """Place every array explicitly on the default device (committed), as jitted steps return them: a fresh cache
    and one returned by a step then share one jit signature, so nothing recompiles after the first step."""
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree_util.tree_map(lambda x: jax.device_put(x, dev), tree)


def _scatter_rows(plane: jax.Array, layer: int, values: jax.Array, positions: jax.Array) -> jax.Array:
    """plane[layer, b, positions[b, t]] = values[b, t]; positions >= capacity are dropped (padding tokens)."""
    B = values.shape[0]
    b_idx = jnp.broadcast_to(jnp.arange(B)[:, None], positions.shape)
    return plane.at[layer, b_idx, positions].set(values.astype(plane.dtype), mode="drop")


def write_rows(cache: KVCache, layer: int, latent: jax.Array, rope: jax.Array, positions: jax.Array) -> KVCache:
    """Store the new MLA rows of one layer (``latent [B,T,kv_lora]``, ``rope [B,T,rope]`` at ``positions [B,T]``).

    Rows are packed into the cache's kv_format here, once, so every later read (hit, miss, ring or resident) sees
    the same bytes: that is what makes offload bit-identical to resident.
    """
    if cache.mode == "offload":
        from glm53 import offload
        return offload.write_rows(cache, layer, latent, rope, positions)
    with jax.named_scope("resident_write"):
        planes = kv_formats.pack(kv_formats.get_format(cache.kv_format), latent, rope)
        history = {name: _scatter_rows(cache.history[name], layer, planes[name], positions)
                   for name in cache.history}
    return cache.replace(history=history)


def write_index_keys(cache: KVCache, layer: int, keys: jax.Array, positions: jax.Array) -> KVCache:
    slot = cache.key_slot_of_layer[layer]
    assert slot >= 0, f"layer {layer} has a shared indexer and caches no keys"
    return cache.replace(index_keys=_scatter_rows(cache.index_keys, slot, keys, positions))


def layer_index_keys(cache: KVCache, layer: int) -> jax.Array:
    return cache.index_keys[cache.key_slot_of_layer[layer]]


def gather_rows(cache: KVCache, layer: int, selected: jax.Array, valid: jax.Array,
                dtype) -> tuple[jax.Array, jax.Array, KVCache]:
    """Dequantised rows at ``selected [B, T, K]`` positions of one layer: ``(latent [B,T,K,kv_lora],
    rope [B,T,K,rope], cache)``. ``valid [B, T, K]`` marks the entries attention will use (real tokens, causal):
    offload mode counts and caches only those; it reads hits, misses and the recent ring and updates the hot
    cache."""
    if cache.mode == "offload":
        from glm53 import offload
        return offload.gather_rows(cache, layer, selected, valid, dtype)
    from kernels_pallas import ops
    B, T, K = selected.shape
    # All layers' planes as [L*B, N, W] (a free reshape) and this layer's offset: slicing out the layer instead would
    # make XLA copy its whole history before the kernel, on every layer of every step.
    planes = {name: p.reshape(-1, *p.shape[2:]) for name, p in cache.history.items()}
    with jax.named_scope("resident_gather"):
        latent, rope = ops.gather_rows(planes, selected.reshape(B, T * K), kv_format=cache.kv_format,
                                       out_dtype=dtype, first_plane=layer * B)
    return latent.reshape(B, T, K, -1), rope.reshape(B, T, K, -1), cache


def advance(cache: KVCache, n_valid: jax.Array) -> KVCache:
    return cache.replace(lengths=cache.lengths + n_valid.astype(jnp.int32))


def advance_mtp(cache: KVCache, n_valid: jax.Array) -> KVCache:
    return cache.replace(mtp_lengths=cache.mtp_lengths + n_valid.astype(jnp.int32))


def describe(cache: KVCache) -> str:
    """A short human-readable summary of the cache pytree (shapes, dtypes, memory kinds)."""
    lines = [f"KVCache(mode={cache.mode}, kv_format={cache.kv_format}, sessions={cache.batch}, "
             f"capacity={cache.capacity} rows, layers={cache.num_layers})"]

    def kind(a):
        try:
            return a.sharding.memory_kind
        except Exception:  # tracers / numpy
            return "?"

    for path, leaf in jax.tree_util.tree_leaves_with_path(cache):
        name = jax.tree_util.keystr(path)
        lines.append(f"  {name:<36} {str(leaf.dtype):<14} {str(tuple(leaf.shape)):<24} {kind(leaf)}")
    return "\n".join(lines)
