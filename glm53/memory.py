"""Capacity accounting: the bytes a cache allocates, computed from its configuration before anything is allocated.

``Engine`` checks its device budget with these figures, and the tests check them against the arrays a built cache
really holds (``jax`` allocations), part by part. Long-lived caches are allocated at their full size up front (the
article's lesson: small logical buffers can hold large physical allocations; counting what is allocated, not what is
used, is what keeps admission honest).
"""

from __future__ import annotations

import numpy as np

from glm53.config import CacheConfig, ModelConfig
from kernels_pallas import kv_formats


def cache_bytes(cfg: ModelConfig, cc: CacheConfig, slots: int, capacity: int, pool_pages: int, dtype) -> dict:
    """``{"device": {part: bytes}, "host": {part: bytes}}`` of a cache of ``slots`` slots of ``capacity`` rows
    (offload: with a host pool of ``pool_pages`` pages). Parts are the cache pytree's fields."""
    from glm53 import offload  # sizes only; offload imports nothing from here

    fmt = kv_formats.get_format(cc.kv_format)
    L, S, N = cfg.num_cache_layers, slots, capacity
    row = fmt.bytes_per_row
    i32 = 4
    device = {
        "sessions": S * (2 * i32 + 4 * cfg.hidden_size),
        "index_keys": len(cfg.full_indexer_layers) * S * N * cfg.index_head_dim * np.dtype(dtype).itemsize,
    }
    host = {}
    if cc.mode == "resident":
        device["history"] = L * S * N * row
        return {"device": device, "host": host}
    P, R, H = cc.copyback_every, offload.ring_rows_for(cc), cc.hot_rows
    device.update({
        "page_table": S * (N // P) * i32, "host_len": S * i32, "ring": L * S * R * row, "hot": L * S * H * row,
        "slot_of_position": L * S * N * i32, "position_of_slot": L * S * H * i32, "pin_round": L * S * H * i32,
        "rounds": L * S * i32, "clock": L * S * i32, "counters": L * S * len(offload.COUNTERS) * i32,
        "bulk_rows": L * S * i32, "copybacks": S * i32, "unassigned": S * i32,
    })
    host["pool"] = max(pool_pages, 1) * L * P * row
    return {"device": device, "host": host}
