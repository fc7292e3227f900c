"""Capacity accounting: the bytes a cache allocates, computed from its configuration before anything is allocated.

``Engine`` checks its device budget with these figures, and the tests check them against the arrays a built cache
really holds (``jax`` allocations), part by part. Long-lived caches are allocated at their full size up front (the
article's lesson: small logical buffers can hold large physical allocations; counting what is allocated, not what is
used, is what keeps admission honest).
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from glm53 import cache, offload
from glm53.config import CacheConfig, ConfigError, ModelConfig
from kernels_pallas import kv_formats


def device_memory() -> dict:
    """What the allocator reports of this process's devices (``Device.memory_stats``; {} where it reports nothing, as
    on a CPU): ``bytes_in_use`` and ``peak_bytes_in_use`` of the device holding the most, ``bytes_limit`` of the
    smallest (a per-device budget), and with several devices ``devices`` and each one's figures (``per_device``):
    a pipeline stage or a tensor-parallel shard fills its own device, and one device's figures would hide the
    fullest."""
    import jax

    keys = ("bytes_in_use", "peak_bytes_in_use", "bytes_limit")
    per = []
    for d in jax.local_devices():
        stats = d.memory_stats() or {}
        per.append({k: int(stats[k]) for k in keys if k in stats})
    if not any(per):
        return {}
    out = {k: (min if k == "bytes_limit" else max)(p[k] for p in per if k in p)
           for k in keys if any(k in p for p in per)}
    if len(per) > 1:
        out.update(devices=len(per), per_device=per)
    return out


def free_bytes(device) -> int | None:
    """What ``device`` can still allocate: its allocator's limit less what is in use (GPUs), or on a CPU the host's
    available memory (``MemAvailable`` of /proc/meminfo, which counts reclaimable page cache); None where neither
    is known."""
    stats = device.memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    if device.platform == "cpu":
        return host_available_bytes()
    return None


def host_available_bytes() -> int | None:
    """The host's available memory (``MemAvailable`` of /proc/meminfo: free plus reclaimable page cache); None
    where the kernel does not say (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def free_memory_problem(need: dict, host_pool: int, devices, *, free_of=None, host_free=None) -> str | None:
    """Why an engine's cache cannot fit in what ``devices`` have free, or None. ``need``: one device's share
    (``Engine._device_need``: ``cache``, ``transient``, ``step_buffers``; the parameters are already allocated);
    ``host_pool``: offload's host pool bytes, all copies. Each accelerator must hold one share (``free_of``, default
    ``free_bytes``). CPU devices share the host's memory (``host_free``, default ``host_available_bytes``), so all of
    their shares must fit in it together with the host pool, which lives there on every platform. Unknown free
    memory is not checked."""
    free_of = free_of or free_bytes
    host_free = host_free or host_available_bytes
    share = need["cache"] + need["transient"] + need["step_buffers"]
    parts = (f"cache {need['cache']:,} bytes, transient {need['transient']:,}, step buffers "
             f"{need['step_buffers']:,}")
    for d in devices:
        free = free_of(d) if d.platform != "cpu" else None
        if free is not None and share > free:
            return (f"the engine's cache needs {size_text(share)} on {d.platform}:{d.id} ({parts}), which has "
                    f"{size_text(free)} free")
    cpus = sum(d.platform == "cpu" for d in devices)
    host = share * cpus + host_pool
    free = host_free() if host else None
    if free is not None and host > free:
        return (f"the engine needs {size_text(host)} of host memory ({cpus} CPU device(s) x {share:,} bytes: "
                f"{parts}; host pool {host_pool:,} bytes), which has {size_text(free)} available")
    return None


def check_weights_fit(cfg: ModelConfig, dtype, expert_weights: str, device, what: str, *, mesh=None,
                      read_itemsize: int | None = None, drawn: bool = False) -> None:
    """Refuse weights that cannot fit where they are made or read (``weights_need``) before the first one is: an
    8.9B-parameter benchmark config on a laptop, or GLM-5 on one GPU, otherwise ran until the allocator or the
    kernel's OOM killer stopped the process, minutes in and without a word on why."""
    from glm53 import params as params_lib

    needs = weights_need(cfg, dtype, expert_weights, device, mesh=mesh, read_itemsize=read_itemsize, drawn=drawn)
    # CPU devices are shares of the host's memory: theirs are counted together against it.
    cpus = [(d, need) for d, need in needs if d.platform == "cpu"]
    checks = [(need, free_bytes(d), f"{d.platform}:{d.id}") for d, need in needs if d.platform != "cpu"]
    if len(cpus) == 1:
        checks.append((cpus[0][1], free_bytes(cpus[0][0]), f"cpu:{cpus[0][0].id}"))
    elif cpus:
        checks.append((sum(n for _, n in cpus), host_available_bytes(), f"the host ({len(cpus)} CPU devices)"))
    for need, free, where in checks:
        if free is not None and need > free:
            n = cfg.param_count()
            count = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
            if mesh is not None:
                where = f"{where}, their shares of a {mesh.devices.size}-device mesh"
            hint = ("a larger mesh" if mesh is not None else
                    "a mesh (each weight goes to its devices as soon as it is made or read)")
            raise ConfigError(
                f"{what}: {count} parameters need {size_text(need)} on {where} "
                f"({np.dtype(params_lib.resolve_dtype(dtype)).name}, experts {expert_weights}), which has "
                f"{size_text(free)} free; use a smaller config (configs/tiny.py runs on a laptop CPU) or {hint}")


def weights_need(cfg: ModelConfig, dtype, expert_weights: str, device, *, mesh=None,
                 read_itemsize: int | None = None, drawn: bool = False) -> list:
    """``[(device, bytes)]`` at the peak of making or reading the weights (``loading_bytes``), for ``device`` (where
    they are made or read) and this process's other devices of ``mesh`` (a ``jax.sharding.Mesh``)."""
    shares, extra = loading_bytes(cfg, dtype, expert_weights, None if mesh is None else mesh.shape,
                                  read_itemsize=read_itemsize, drawn_on=device.platform if drawn else None)
    if mesh is None:
        return [(device, shares[0] + extra)]
    needs = [(d, shares[s] + (extra if d == device else 0)) for s, row in enumerate(mesh.devices) for d in row
             if d.process_index == device.process_index]
    if device not in mesh.devices.flat:
        needs.append((device, extra))
    return needs


def loading_bytes(cfg: ModelConfig, dtype, expert_weights: str, mesh_shape: Mapping[str, int] | None, *,
                  read_itemsize: int | None = None, drawn_on: str | None = None) -> tuple[list[int], int]:
    """``(shares, extra)`` at the peak of making or reading the weights: each device of pipeline stage ``s`` of a
    mesh of ``mesh_shape`` holds ``shares[s]`` (its share of its stage's weights; one entry without stages), and the
    device they are made on ``extra`` more. Each weight goes to its devices as soon as it exists
    (``glm53.sharding.Placement``), so ``extra`` is one weight as made beside its model-dtype copy before that
    moves: the largest weight twice, or when reading a checkpoint of wider elements (``read_itemsize``, e.g.
    float32 weights into a bfloat16 model) the largest as read beside its copy (``glm53.checkpoint`` makes each
    tensor the model's in one program, so no third copy). On one device the kept copy is the model's: ``extra`` is
    the largest as read, or with FP8 experts the largest expert stack in the model's dtype beside the FP8 model
    (each stack is quantised as it is made). ``drawn_on``: random weights drawn on a device of this platform, whose
    draw adds one block's temporaries there (``glm53.params.draw_transient_bytes``)."""
    import jax

    from glm53 import params as params_lib
    from glm53 import pipeline, sharding

    shapes = params_lib.param_shapes(cfg, dtype, expert_weights)
    kept = jax.tree_util.tree_leaves(params_lib.param_shapes(cfg, dtype))  # as made: the model's dtype, unquantised

    def as_made(x) -> int:
        return int(np.prod(x.shape)) * max(read_itemsize or 0, np.dtype(x.dtype).itemsize)

    shape = dict(mesh_shape or {})
    stages, tp = int(shape.get("stage", 1)), int(shape.get("tp", 1))
    drawing = params_lib.draw_transient_bytes(kept, drawn_on) if drawn_on else 0
    if stages * tp == 1:
        if read_itemsize:
            extra = max(as_made(x) for x in kept)
        else:
            extra = max(params_lib.nbytes(x) for x in kept) if expert_weights == "fp8" else 0
        return [params_lib.nbytes(shapes)], extra + drawing
    trees = [shapes]
    if stages > 1:
        trees = pipeline.stage_param_trees(cfg, pipeline.stage_layers(cfg, stages, shapes), shapes)
    extra = max(as_made(x) + params_lib.nbytes(x) for x in kept)
    return [sharding.shard_bytes(t, {"stage": 1, "tp": tp}) for t in trees], extra + drawing


def size_text(n: int) -> str:
    """Bytes as people read them: ``1.5 GiB``, ``12.0 MiB``."""
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def engine_cache_config(cfg: ModelConfig, cc: CacheConfig, capacity: int) -> CacheConfig:
    """``cc`` as an engine of ``capacity`` rows per slot runs it: offload's ``hot_rows`` cut to what a slot can fill
    (``glm53.offload.hot_rows_for``), so the bytes counted here are the ones the engine allocates."""
    if cc.mode != "offload":
        return cc
    return cc.replace(hot_rows=offload.hot_rows_for(cfg, cc, capacity))


def _check_counted(cfg: ModelConfig, cc: CacheConfig, **counts) -> None:
    """Refuse what no engine could be before counting it: a count of sessions or history rows below one (or not a
    whole number) gave zero, negative or fractional bytes, and an offload cache ``Engine`` refuses
    (``glm53.offload.validate``) figures for nothing that can run. A history past the model's positions is counted:
    plans size hypothetical contexts (the article's 1M tokens on GLM-5)."""
    for name, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ConfigError(f"{name} must be an int >= 1, got {value!r}")
    if cc.mode == "offload":
        offload.validate(cfg, cc)


def _plane_bytes(shapes: dict) -> int:
    """Bytes of ``{plane: (shape, dtype)}`` (padding rows included)."""
    return sum(int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize for shape, dt in shapes.values())


def cache_bytes(cfg: ModelConfig, cc: CacheConfig, slots: int, capacity: int, pool_pages: int, dtype) -> dict:
    """``{"device": {part: bytes}, "host": {part: bytes}}`` of a cache of ``slots`` slots of ``capacity`` rows
    (offload: with a host pool of ``pool_pages`` pages). Parts are the cache pytree's fields; the row planes are
    counted with their padding rows (``glm53.cache.addressable_planes``), as allocated."""
    fmt = kv_formats.get_format(cc.kv_format)
    L, S, N = cfg.num_cache_layers, slots, capacity
    row = fmt.bytes_per_row
    i32 = 4
    keys = cache.index_key_shapes(cfg, cc, S, N, dtype)  # with the padding slots fp8 keys may need
    device = {"sessions": S * (2 * i32 + 4 * cfg.hidden_size),
              "index_keys": _plane_bytes({"keys": keys["index_keys"]})}
    if keys["index_key_scale"] is not None:
        device["index_key_scale"] = _plane_bytes({"scale": keys["index_key_scale"]})
    host = {}
    if cc.mode == "resident":
        device["history"] = _plane_bytes(cache.history_shapes(cfg, cc, S, N))
        return {"device": device, "host": host}
    P, H = cc.copyback_every, cc.hot_rows
    device.update({
        "page_table": S * (N // P) * i32, "host_len": S * i32,
        "ring": _plane_bytes(offload.ring_shapes(cfg, cc, S)), "hot": _plane_bytes(offload.hot_shapes(cfg, cc, S)),
        "slot_of_position": L * S * N * offload.slot_map_dtype(H).itemsize, "position_of_slot": L * S * H * i32,
        "pin_round": L * S * H * i32,
        "rounds": L * S * i32, "clock": L * S * i32, "counters": L * S * len(offload.COUNTERS) * i32,
        "bulk_pages": L * S * i32, "copybacks": S * i32, "unassigned": S * i32,
        **{f"policy_state.{n}": L * S * H * i32 for n in offload.POLICY_STATE[cc.policy]},
    })
    host["pool"] = max(pool_pages, 1) * L * P * row
    return {"device": device, "host": host}


# Pallas' Triton lowering addresses an operand with 32-bit offsets unless the array is larger than 2**32 bytes
# (``64 if full_size > 2**32 else 32`` in ``_compute_offsets_from_indices``, jax/_src/pallas/triton/lowering.py:
# line 1909 in JAX 0.10.2; kernels_pallas.hot_gather's module doc has the details), and Triton adds a 32-bit offset
# to a pointer as a signed number: an array of 2**31 or more elements that is at most 2**32 bytes (only 1-byte
# dtypes can be both: the int8 / fp8 latent planes, and fp8 indexer keys, which get padding key slots of their own:
# ``glm53.cache.index_key_shapes``) is addressed wrongly past element 2**31 (illegal memory accesses
# on the H200: a 10 x 50K-row cache's int8 latents are 2.5 GB). Such arrays are grown past 2**32 bytes, into the
# 64-bit regime, instead, by rows that nothing uses: the device planes (hot cache, ring, resident history) by padding
# rows of that plane alone (``glm53.cache.addressable_planes``), the host pool by whole pages (below, since the pool
# is handed out in pages); the compiled kernels refuse them otherwise. Phantom session *slots* (every per-slot
# array grown: 29 slots for 16 sessions at the H200 target, 17.3 GiB of indexer keys and maps for nothing) are gone.
def _addressable(elements: int, itemsize: int) -> bool:
    return elements < 2 ** 31 or elements * itemsize > 2 ** 32


def _narrow_planes(cc: CacheConfig) -> list[tuple[int, int]]:
    """(width, itemsize) of the row planes of 1 byte per element."""
    fmt = kv_formats.get_format(cc.kv_format)
    return [(shape[-1], np.dtype(dt).itemsize) for shape, dt in fmt.plane_shapes(1).values()
            if np.dtype(dt).itemsize == 1]


def allocated_slots(cfg: ModelConfig, cc: CacheConfig, slots: int, capacity: int) -> int:
    """Slots to allocate for ``slots`` sessions: ``slots``. The planes a kernel addresses get padding rows instead
    of phantom slots (``glm53.cache.addressable_planes``); kept for callers that report it."""
    del cfg, cc, capacity
    return slots


def allocated_pages(cfg: ModelConfig, cc: CacheConfig, pages: int, layer_counts: tuple[int, ...] | None = None
                    ) -> int:
    """Host pool pages to allocate for ``pages`` usable ones (see above). ``layer_counts``: the cache layers of each
    pool sharing the page table (pipeline stages: ``Pipeline.layer_counts``); every pool must be addressable."""
    counts = layer_counts or (cfg.num_cache_layers,)
    p = max(pages, 1)
    while not all(_addressable(p * n * cc.copyback_every * w, b) for n in counts for w, b in _narrow_planes(cc)):
        p = max(p + 1, int(p * 1.01))
    return p


# ----------------------------------------------------------------------------------------------------------------
# Planning: will N sessions of history H fit a machine?
# ----------------------------------------------------------------------------------------------------------------
# Machines to plan for: devices, GiB per device, GiB of host memory per host, devices per host.
MACHINES = {
    "article": (16, 48, 1024, 8),  # the article's 2 hosts x 8 accelerators of 48 GiB, 1 TiB of RAM per host
    "h200x8": (8, 139, 560, 8),  # nvidia-h200-x8: 8 H200 (about 139 GiB each usable), 560 GiB of host memory
    "h200": (1, 139, 125, 1),  # one H200 with the lent machine's 125 GiB
}


def machine_mesh(cfg: ModelConfig, mesh, devices: int) -> dict:
    """The ``{"stage": S, "tp": T}`` the machine's ``devices`` are planned as: ``mesh.stages`` stages of
    ``devices / S`` tensor-parallel devices. Refused, with what is wrong, where no engine could be built so: stages
    not dividing the devices, a ``mesh.tp`` other than the one that follows (it would be silently replaced), tp not
    dividing the heads, more stages than layers."""
    from glm53 import sharding

    mc = sharding.MeshConfig.from_config_dict(mesh)  # every setting an int >= 1
    if devices % mc.stages:
        raise ConfigError(f"mesh.stages={mc.stages} does not divide the machine's {devices} devices")
    tp = devices // mc.stages
    if mc.tp not in (1, tp):
        raise ConfigError(f"mesh.tp={mc.tp}: the planner lays the machine's {devices} devices out as {mc.stages} "
                          f"stage(s) x tp={tp} (tp follows from the machine and mesh.stages); drop it, or choose a "
                          "machine of stages x tp devices")
    try:
        sharding.check_shape(cfg, mc.stages, tp)
    except ConfigError as e:
        raise ConfigError(f"{devices} devices as {mc.stages} stage(s) x tp={tp}: {e}") from None
    return {"stage": mc.stages, "tp": tp}


MAX_MTP_DEPTH = 3


def step_buffers_bytes(cfg: ModelConfig, sessions: int, topk: int, copies: int) -> int:
    """The most device bytes an engine's output rings keep between generate calls (``glm53.engine._RingBuffers``,
    one set per step, the last loop's): ``copies`` sets of the decode and (with an MTP module) verify steps'
    outputs and selection overrides at the largest bucket (``sessions`` lanes), verify at depth 3 with sampling's
    draft distributions, and the loops' fixed inputs. Logits are float32. 0 without a ring (``copies`` <= 1)."""
    if copies <= 1:
        return 0
    B, V, D = sessions, cfg.vocab_size, MAX_MTP_DEPTH
    has_mtp = bool(cfg.num_nextn_predict_layers)
    decode = B * (4 + 4 * V + 4)  # tokens, logits, remaining
    # emitted, n_emit, logits, pending, drafts, draft_p, remaining, accepted
    verify = B * ((D + 1) * 4 + 4 + (D + 1) * V * 4 + 4 + D * 4 + D * V * 4 + 4 + 4) if has_mtp else 0
    steps = 1 + int(has_mtp)
    fixed = B * 5 + 3 * 4 + 4 * 1024  # lanes, seed / temperature / top_p, stop ids (up to 1,024)
    return copies * (decode + verify + steps * B * topk * 4) + steps * fixed


def plan(cfg: ModelConfig, cc: CacheConfig, *, sessions: int, history: int, dtype, mesh_shape: dict | None = None,
         expert_weights: str = "model", device_bytes: int | None = None, host_bytes: int | None = None,
         devices_per_host: int | None = None, output_ring: int = 1) -> dict:
    """What an engine of ``sessions`` slots of ``history`` rows each allocates, per device and per host, on a mesh
    of ``mesh_shape`` ({"stage": s, "tp": t}; one device by default), computed from shapes alone: the parameters'
    shards under ``glm53.sharding``'s rules, the cache (replicated over the mesh: every device holds every
    session's rows), the largest transient buffer, and (offload) the host pool. Every figure is the one
    ``Engine.memory_report()`` gives for the same engine (tested equal). With ``device_bytes`` / ``host_bytes``
    it says whether the plan fits and how many sessions of this history would, and whether the weights can be
    loaded (``per_device["loading"]``, ``loading_bytes``: each device its share, the one they are made on the
    weight being made too).

    The host pool is replicated over tensor-parallel devices like the rest of the cache: each device keeps a copy
    in its host's memory, so a host holds ``devices_per_host`` copies (default: every device of the mesh on one
    host). With pipeline stages (``glm53.pipeline``) each stage holds its layers' weights, cache and pool: a
    device's figures are its stage's (``per_device`` gives the largest, ``stages`` each), and a host holds the pools
    of its devices' stages. The owner / peer split within a tensor-parallel group is not built yet.

    ``output_ring``: the engine's (``glm53.engine.output_ring_for``: 3 on one GPU, else 1); its kept step buffers
    (``step_buffers_bytes``) count in the device's total."""
    from glm53 import pipeline, sharding  # kept local to stay out of import cycles
    from glm53.params import param_shapes

    _check_counted(cfg, cc, sessions=sessions, history=history)
    mesh_shape = dict(mesh_shape or {"stage": 1, "tp": 1})
    stages, tp = int(mesh_shape.get("stage", 1)), int(mesh_shape.get("tp", 1))
    sharding.check_shape(cfg, stages, tp)  # a layout no engine could be built on is refused, not planned
    devices = stages * tp
    capacity = cache.capacity_for(history, cc)
    cc = engine_cache_config(cfg, cc, capacity)
    pages_per_slot = capacity // cc.copyback_every if cc.mode == "offload" else 0
    shapes = param_shapes(cfg, dtype, expert_weights)
    if stages > 1:  # glm53.pipeline: each stage its layers' weights and cache, over its tp devices
        layers = pipeline.stage_layers(cfg, stages, shapes)
        configs = [pipeline.StageConfig(cfg, ls) for ls in layers]
        trees = pipeline.stage_param_trees(cfg, layers, shapes)
        counts = tuple(len(ls) for ls in layers)
    else:
        configs, trees, counts = [cfg], [shapes], None

    def cache_at(slots: int) -> list[dict]:  # per stage
        pages = allocated_pages(cfg, cc, slots * pages_per_slot, counts) if cc.mode == "offload" else 0
        return [cache_bytes(c, cc, slots, capacity, pages, dtype) for c in configs]

    # A host holds devices_per_host consecutive devices (default: all); device d is in stage d // tp, and keeps a
    # copy of its stage's pool in its host's memory.
    per_host_devices = int(devices_per_host or devices) if cc.mode == "offload" else 0

    def host_total(parts: list[dict]) -> int:
        if not per_host_devices:
            return 0
        pools = [sum(p["host"].values()) for p in parts]
        return max(sum(pools[d // tp] for d in range(h, min(h + per_host_devices, devices)))
                   for h in range(0, devices, per_host_devices))

    parts = cache_at(sessions)
    params = [sharding.shard_bytes(t, {"stage": 1, "tp": tp}) for t in trees]
    shares, extra = loading_bytes(cfg, dtype, expert_weights, mesh_shape)
    transient = capacity * kv_formats.get_format(cc.kv_format).bytes_per_row if cc.mode == "offload" else 0
    topk = min(cfg.index_topk, capacity)
    rings = step_buffers_bytes(cfg, sessions, topk, output_ring)
    device_cache = [sum(p["device"].values()) for p in parts]
    totals = [pb + c + transient + rings for pb, c in zip(params, device_cache)]
    largest_cache = int(np.argmax(device_cache))
    out = {
        "sessions": sessions, "history": history, "capacity": capacity, "mode": cc.mode, "kv_format": cc.kv_format,
        "index_keys": cc.index_keys, "mesh": mesh_shape, "devices": devices,
        # Per device: the largest figures of any device (with stages: of any stage's devices).
        "per_device": {"params": max(params), "cache": max(device_cache),
                       "cache_parts": parts[largest_cache]["device"], "transient": transient,
                       "step_buffers": rings, "total": max(totals),
                       # before any cache: at the peak of making or reading the weights (the device they are
                       # made on: the first stage's)
                       "loading": max(shares[0] + extra, max(shares))},
        "per_host": {"pool": max(sum(p["host"].values()) for p in parts),
                     "pool_replicas": (per_host_devices if stages == 1 else tp) if cc.mode == "offload" else 0,
                     "total": host_total(parts)},
    }
    if stages > 1:
        out["stages"] = [{"layers": list(c.layers), "params": pb, "cache": dc, "total": t,
                          "pool": sum(p["host"].values())}
                         for c, pb, dc, t, p in zip(configs, params, device_cache, totals, parts)]
    # Sessions that fit: searched, not divided out, since the addressing pads (glm53.cache.addressable_planes,
    # allocated_pages) make the bytes slightly non-linear in the number of slots.
    def largest(fits) -> int:
        lo, hi = 0, 1
        while fits(hi) and hi < 1 << 24:
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo

    if device_bytes is not None:
        out["device_bytes"] = int(device_bytes)
        out["fits_device"] = out["per_device"]["total"] <= device_bytes
        out["fits_loading"] = out["per_device"]["loading"] <= device_bytes
        out["max_sessions_by_device"] = largest(
            lambda n: max(pb + transient + step_buffers_bytes(cfg, n, topk, output_ring) + sum(p["device"].values())
                          for pb, p in zip(params, cache_at(n))) <= device_bytes)
    if host_bytes is not None and cc.mode == "offload":
        out["host_bytes"] = int(host_bytes)
        out["fits_host"] = out["per_host"]["total"] <= host_bytes
        out["max_sessions_by_host"] = largest(lambda n: host_total(cache_at(n)) <= host_bytes)
    return out


# ----------------------------------------------------------------------------------------------------------------
# The article's accounting, and what it left out
# ----------------------------------------------------------------------------------------------------------------
MiB, GiB = 1 << 20, 1 << 30


def article_figures(cfg: ModelConfig, cc: CacheConfig, *, replicas: int = 2, sessions: int = 15) -> list[dict]:
    """The MLA payload figures of the article (``kv-offload-article.md``), computed from a config: one row format
    (``cc.kv_format``), the main model's ``cfg.num_hidden_layers`` layers, ``replicas`` copies (the article's owner
    and peer), ``cfg.index_topk`` selected rows, ``cc.hot_rows`` hot rows. MLA only: no DSA keys, MTP layer,
    metadata or padding (``session_bytes`` has those). Each row: ``{"what", "bytes", "value", "unit"}``."""
    row = kv_formats.get_format(cc.kv_format).bytes_per_row
    L = cfg.num_hidden_layers
    one_m = 1 << 20
    rows = [("row", row, "B", 1),
            ("50,000 tokens, one layer, one replica", 50_000 * row, "MiB", MiB),
            (f"50,000 tokens, {L} main-model layers, both replicas", 50_000 * row * L * replicas, "GiB", GiB),
            (f"{cfg.index_topk:,} selected rows, one layer, one replica", cfg.index_topk * row, "MiB", MiB),
            (f"{cc.hot_rows:,} hot-cache rows, one layer, one replica", cc.hot_rows * row, "MiB", MiB),
            ("one 1M history (1,048,576 tokens), all layers, both replicas", one_m * row * L * replicas, "GiB", GiB),
            (f"{sessions} such sessions", sessions * one_m * row * L * replicas, "GiB", GiB),
            (f"{sessions} hot caches of {cc.hot_rows:,} rows, all layers, both replicas",
             sessions * cc.hot_rows * row * L * replicas, "GiB", GiB)]
    return [{"what": w, "bytes": int(b), "value": b / d, "unit": u} for w, b, u, d in rows]


def session_bytes(cfg: ModelConfig, cc: CacheConfig, history: int, dtype) -> dict:
    """Everything one session of ``history`` tokens allocates in glm53 (one replica), by part: ``{"device": {part:
    bytes}, "host": {part: bytes}, "transient": bytes, "capacity": rows}``. The cache parts are one slot's share of
    ``cache_bytes`` (so ``Engine.memory_report()``'s per-slot figure, tested equal), with every cache layer (the MTP
    layer too), the indexer keys, slot maps, ring and page rounding; ``transient`` is the largest buffer a
    prefill / append chunk adds (offload's bulk read of one layer)."""
    _check_counted(cfg, cc, history=history)
    capacity = cache.capacity_for(history, cc)
    cc = engine_cache_config(cfg, cc, capacity)
    pages = capacity // cc.copyback_every if cc.mode == "offload" else 0
    # A slot's share of an engine of 2**24 slots: every part is slots x its per-slot size, and at this many slots no
    # plane is in the range that gets addressing pads (glm53.cache.padded_rows: a whole-array effect of some engine
    # sizes, which Engine.memory_report() includes and this leaves out).
    many = 1 << 24
    big = cache_bytes(cfg, cc, many, capacity, many * pages, dtype)
    per = {side: {k: v // many for k, v in big[side].items()} for side in ("device", "host")}
    transient = capacity * kv_formats.get_format(cc.kv_format).bytes_per_row if cc.mode == "offload" else 0
    return {**per, "transient": transient, "capacity": capacity}


# ----------------------------------------------------------------------------------------------------------------
# XLA's own accounting: the step compiled ahead of time from shapes
# ----------------------------------------------------------------------------------------------------------------
def abstract_engine_state(cfg: ModelConfig, cc: CacheConfig, *, sessions: int, history: int, dtype,
                          mesh=None, expert_weights: str = "model", device=None):
    """The parameters and the cache an engine of ``sessions`` slots x ``history`` rows would hold, as
    ``ShapeDtypeStruct``s placed as the engine places them (parameters by ``glm53.sharding``'s rules on ``mesh``,
    the cache replicated over it, the host pool in ``pinned_host`` memory): nothing is allocated. The slot and page
    counts are the engine's (``Engine.__init__``: one slot per session, every session's pages in the pool)."""
    import jax

    from glm53 import sharding
    from glm53.params import param_shapes, resolve_dtype

    dtype = resolve_dtype(dtype)
    device = device or jax.local_devices()[0]

    def placed(memory_kind: str = "device"):
        if mesh is None:
            return jax.sharding.SingleDeviceSharding(device, memory_kind=memory_kind)
        return sharding.replicated(mesh, memory_kind)

    params = param_shapes(cfg, dtype, expert_weights)
    where = (sharding.param_shardings(params, mesh) if mesh is not None
             else jax.tree.map(lambda _: placed(), params))
    params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), params, where)
    capacity = cache.capacity_for(history, cc)
    cc = engine_cache_config(cfg, cc, capacity)
    if cc.mode == "offload":
        pages = allocated_pages(cfg, cc, sessions * (capacity // cc.copyback_every))
        planes = kv_formats.get_format(cc.kv_format).plane_shapes(offload.pool_rows(cfg, cc, pages))
        pool = {n: jax.ShapeDtypeStruct(shape, dt) for n, (shape, dt) in planes.items()}
        state = jax.eval_shape(lambda p: offload.init_offload(cfg, cc, sessions, capacity, pages, dtype,
                                                              device=device, pool=p), pool)
    else:
        state = jax.eval_shape(lambda: cache.init_resident(cfg, cc, sessions, capacity, dtype, device=device))

    def place(path, x):
        kind = "pinned_host" if getattr(path[0], "name", None) == "pool" else "device"
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=placed(kind))

    return params, jax.tree_util.tree_map_with_path(place, state), placed


def lower_step(cfg: ModelConfig, cc: CacheConfig, *, sessions: int, history: int, dtype, mesh=None,
               expert_weights: str = "model", mtp: int = 0, kernels: str = "auto", device=None):
    """The engine's decode step (``mtp=0``) or MTP verify step of depth ``mtp``, lowered (not compiled) on the
    abstract state of ``abstract_engine_state``: greedy, no selection override, ``sessions`` lanes. Returns
    ``(lowered, small)``: the lowering and the lanes' small inputs it was given (their bytes count as arguments)."""
    import jax
    import jax.numpy as jnp

    from glm53.model import GLM5
    from glm53.params import resolve_dtype
    from glm53.steps import Steps

    dtype = resolve_dtype(dtype)
    params, state, placed = abstract_engine_state(cfg, cc, sessions=sessions, history=history, dtype=dtype,
                                                  mesh=mesh, expert_weights=expert_weights, device=device)
    B = sessions

    def arg(shape, dt):
        return jax.ShapeDtypeStruct(shape, dt, sharding=placed())

    lanes = cache.Lanes(slot=arg((B,), jnp.int32), active=arg((B,), jnp.bool_))
    scalars = (arg((), jnp.int32), arg((), jnp.float32), arg((), jnp.float32))  # seed, temperature, top_p
    stop_ids = arg((8,), jnp.int32)  # Engine._stop_ids pads to at least 8
    steps = Steps(GLM5(cfg, dtype))
    if mtp == 0:
        pages = offload.copy_pages_for(cc, 1) if cc.mode == "offload" else 0
        small = (arg((B,), jnp.int32), arg((B,), jnp.int32)) + scalars + (stop_ids,)
        lowered = steps.lower("decode", params, state, lanes, *small, None, greedy=True, kernels=kernels,
                              copy_pages=pages)
    else:
        pages = offload.copy_pages_for(cc, mtp + 1) if cc.mode == "offload" else 0
        small = (arg((B,), jnp.int32), arg((B, mtp), jnp.int32), None, arg((B,), jnp.int32)) + scalars + (stop_ids,)
        lowered = steps.lower("verify", params, state, lanes, *small, None, greedy=True, accept_override=None,
                              kernels=kernels, copy_pages=pages)
    return lowered, (lanes, small)


def compiled_step_memory(cfg: ModelConfig, cc: CacheConfig, *, sessions: int, history: int, dtype, mesh=None,
                         expert_weights: str = "model", mtp: int = 0, kernels: str = "auto", device=None) -> dict:
    """What XLA allocates for one step of an engine of ``sessions`` slots x ``history`` rows, per device: the decode
    step (``mtp=0``) or the MTP verify step of depth ``mtp`` (T = mtp + 1 rows a lane), compiled ahead of time on
    abstract shapes (``abstract_engine_state``: no weights, no cache), from ``compiled.memory_analysis()``:

    - ``argument_bytes`` / ``host_argument_bytes``: the step's inputs in device / host memory (parameters, cache,
      the lanes' small inputs); ``alias_bytes``: the part donated and updated in place (the cache);
    - ``temp_bytes``: the workspace the step needs beside its inputs and outputs (activations, gathered rows, the
      kernels' buffers) -- what counting shapes (``plan``) cannot know;
    - ``peak_bytes``: the device memory the step runs in: what the engine holds (``counted``: every parameter
      shard and the device cache, read by this step or not) + the workspace + the outputs not written in place.

    ``argument_bytes`` is a check on the counting: it is what ``counted`` says minus the arguments the step does
    not read (``tests/test_plan.py``). A CPU has no separate host memory space: the pool counts in
    ``argument_bytes`` there, in ``host_argument_bytes`` on a GPU.

    The workspace is the compiling backend's: a CPU compiles the steps' pure-jnp references (``kernels="auto"``
    picks them there), whose MoE gathers the routed experts' weights, so its ``temp_bytes`` are not a GPU's; run
    it where the engine will run. ``counted`` holds ``plan``'s figures for the same engine beside them."""
    import time

    import jax

    from glm53.params import resolve_dtype

    dtype = resolve_dtype(dtype)
    t0 = time.perf_counter()
    lowered, small = lower_step(cfg, cc, sessions=sessions, history=history, dtype=dtype, mesh=mesh,
                                expert_weights=expert_weights, mtp=mtp, kernels=kernels, device=device)
    compiled = lowered.compile()
    compile_s = time.perf_counter() - t0
    ma = compiled.memory_analysis()
    small_bytes = sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(small))
    out = {
        "step": "decode" if mtp == 0 else f"verify (MTP depth {mtp})", "backend": jax.default_backend(),
        "kernels": kernels, "sessions": sessions, "history": history, "compile_s": round(compile_s, 2),
        "devices": 1 if mesh is None else int(mesh.size),
        "argument_bytes": int(ma.argument_size_in_bytes), "host_argument_bytes": int(ma.host_argument_size_in_bytes),
        "output_bytes": int(ma.output_size_in_bytes), "alias_bytes": int(ma.alias_size_in_bytes),
        "temp_bytes": int(ma.temp_size_in_bytes), "host_temp_bytes": int(ma.host_temp_size_in_bytes),
        "small_input_bytes": small_bytes,
    }
    mesh_shape = None if mesh is None else dict(mesh.shape)
    counted = plan(cfg, cc, sessions=sessions, history=history, dtype=dtype, mesh_shape=mesh_shape,
                   expert_weights=expert_weights)
    out["counted"] = {"params": counted["per_device"]["params"], "cache": counted["per_device"]["cache"],
                      "pool": counted["per_host"]["pool"]}
    # The engine holds every parameter and the whole cache whether or not this step reads them (jit drops unused
    # arguments from argument_bytes), so the step runs in what is held plus its workspace and the outputs it does
    # not write in place.
    out["peak_bytes"] = (out["counted"]["params"] + out["counted"]["cache"] + small_bytes + out["temp_bytes"]
                         + out["output_bytes"] - out["alias_bytes"])
    return out


def compiled_stage_memory(cfg: ModelConfig, cc: CacheConfig, *, sessions: int, history: int, dtype, mesh,
                          expert_weights: str = "model", mtp: int = 0, kernels: str = "auto") -> dict:
    """``compiled_step_memory`` for pipeline stages (``glm53.pipeline``; ``mesh`` has ``stage`` > 1): each stage's
    programs of a decode step (``mtp=0``) or an MTP verify step (with the commit an earlier stage runs after the last
    stage's acceptance) compiled ahead of time on abstract shapes: the stage's parameters and cache placed on its
    devices, the activation it receives. Per stage the largest workspace of its programs and the peak its devices
    run in (what they hold, counted by ``plan``, plus workspace and outputs not written in place); ``peak_bytes``
    the largest of them."""
    import functools
    import time

    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from glm53 import pipeline, sharding
    from glm53.model import GLM5
    from glm53.params import param_shapes, resolve_dtype

    dtype = resolve_dtype(dtype)
    t0 = time.perf_counter()
    shapes = param_shapes(cfg, dtype, expert_weights)
    pipe = pipeline.Pipeline(cfg, dtype, mesh, shapes)
    steps = pipeline.PipelineSteps(pipe, GLM5(cfg, dtype))
    trees = pipeline.stage_param_trees(cfg, pipe.layers, shapes)
    capacity = cache.capacity_for(history, cc)
    cc = engine_cache_config(cfg, cc, capacity)
    pages = (allocated_pages(cfg, cc, sessions * (capacity // cc.copyback_every), pipe.layer_counts)
             if cc.mode == "offload" else 0)
    counted = plan(cfg, cc, sessions=sessions, history=history, dtype=dtype, mesh_shape=dict(mesh.shape),
                   expert_weights=expert_weights)
    B, T = sessions, mtp + 1
    copy_pages = offload.copy_pages_for(cc, T) if cc.mode == "offload" else 0
    out_stages = []
    for st, tree, count in zip(pipe.stages, trees, counted["stages"]):
        rep = st.replicated

        def arg(shape, dt, sh=rep):
            return jax.ShapeDtypeStruct(shape, dt, sharding=sh)

        params = jax.tree.map(lambda x, sh: arg(x.shape, x.dtype, sh), tree,
                              sharding.param_shardings(tree, st.mesh))
        if cc.mode == "offload":
            planes = kv_formats.get_format(cc.kv_format).plane_shapes(offload.pool_rows(st.config, cc, pages))
            pool = {n: jax.ShapeDtypeStruct(shape, dt) for n, (shape, dt) in planes.items()}
            state = jax.eval_shape(lambda p, st=st: offload.init_offload(st.config, cc, sessions, capacity, pages,
                                                                         dtype, pool=p), pool)
        else:
            state = jax.eval_shape(lambda st=st: cache.init_resident(st.config, cc, sessions, capacity, dtype))
        state = jax.tree_util.tree_map_with_path(
            lambda path, x: arg(x.shape, x.dtype, NamedSharding(st.mesh, P(), memory_kind=(
                "pinned_host" if getattr(path[0], "name", None) == "pool" else "device"))), state)
        lanes = cache.Lanes(slot=arg((B,), jnp.int32), active=arg((B,), jnp.bool_))
        tokens, remaining = arg((B,), jnp.int32), arg((B,), jnp.int32)
        drafts = arg((B, mtp), jnp.int32)
        carry = None if st.first else (arg((B, T, cfg.hidden_size), dtype),
                                       arg((B, T, min(cfg.index_topk, capacity)), jnp.int32))
        lowered = []
        if not st.last:
            if mtp == 0:
                lowered.append(steps._early("decode", st.index, state).lower(
                    params, state, lanes, tokens, carry, remaining, None, kernels=kernels, copy_pages=copy_pages))
            else:
                fn = steps._early("verify", st.index, state)
                lowered.append(fn.lower(params, state, lanes, tokens, drafts, carry, remaining, None,
                                        kernels=kernels, copy_pages=copy_pages))
                rounds = jax.eval_shape(functools.partial(pipeline.stage_verify, st, kernels=kernels,
                                                          copy_pages=copy_pages),
                                        params, state, lanes, tokens, drafts, carry, remaining)[1][1]
                rounds = jax.tree_util.tree_map(lambda x: arg(x.shape, x.dtype), rounds)
                lowered.append(steps._early("verify_commit", st.index, state).lower(
                    state, lanes, remaining, rounds, tokens, T=T, kernels=kernels))
        else:
            scalars = (arg((), jnp.int32), arg((), jnp.float32), arg((), jnp.float32))
            stop_ids = arg((8,), jnp.int32)
            p = dict(params, carry=carry)
            if mtp == 0:
                lowered.append(steps.last.lower("decode", p, state, lanes, tokens, remaining, *scalars, stop_ids, None,
                                                greedy=True, kernels=kernels, copy_pages=copy_pages))
            else:
                lowered.append(steps.last.lower("verify", p, state, lanes, tokens, drafts, None, remaining, *scalars,
                                                stop_ids, None, greedy=True, accept_override=None, kernels=kernels,
                                                copy_pages=copy_pages))
        analyses = [lw.compile().memory_analysis() for lw in lowered]
        temp = max(int(ma.temp_size_in_bytes) for ma in analyses)
        fresh = max(int(ma.output_size_in_bytes) - int(ma.alias_size_in_bytes) for ma in analyses)
        out_stages.append({
            "layers": count["layers"], "programs": len(analyses),
            "argument_bytes": max(int(ma.argument_size_in_bytes) for ma in analyses),
            "host_argument_bytes": max(int(ma.host_argument_size_in_bytes) for ma in analyses),
            "temp_bytes": temp, "outputs_not_in_place_bytes": fresh,
            "counted": {"params": count["params"], "cache": count["cache"], "pool": count["pool"]},
            "peak_bytes": count["params"] + count["cache"] + temp + fresh})
    return {"step": "decode" if mtp == 0 else f"verify (MTP depth {mtp})", "backend": jax.default_backend(),
            "kernels": kernels, "sessions": sessions, "history": history, "devices": int(mesh.size),
            "compile_s": round(time.perf_counter() - t0, 2), "stages": out_stages,
            "temp_bytes": max(s["temp_bytes"] for s in out_stages),
            "peak_bytes": max(s["peak_bytes"] for s in out_stages)}
