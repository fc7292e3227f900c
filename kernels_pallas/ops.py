"""The ops the model calls: each runs the Pallas kernel or its jnp reference, as the caller's ``impl`` says.

``impl`` is a static argument of the caller's step (never module state or an environment variable), one of:

* ``"auto"``: the Pallas kernels on GPU backends (CUDA, ROCm; Triton lowering), the jnp references on the CPU,
  where Pallas only exists as the interpreter, orders of magnitude slower;
* ``"pallas"``: the kernels, interpreted where there is no GPU (tests of the kernels inside the whole model);
* ``"reference"``: the references.

The tests pin kernel == reference, so every choice computes the same function.

Memory spaces: XLA's gathers and scatters, and so the Pallas interpreter, cannot take ``pinned_host`` operands.
On those paths an op first moves host operands to the device (and ``copy_blocks`` moves its result back to host
memory when ``dst`` lived there); on the CPU both memories are host RAM, so that costs a copy and nothing else. The
compiled GPU kernels read and write host operands in place, zero-copy.
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np

# The package re-exports functions named like these modules, so fetch the modules themselves.
_gather = importlib.import_module("kernels_pallas.gather_rows")
_hot = importlib.import_module("kernels_pallas.hot_gather")
_indexer = importlib.import_module("kernels_pallas.indexer_topk")
_fill = importlib.import_module("kernels_pallas.fill_rows")
_fill_round = importlib.import_module("kernels_pallas.fill_round")
_copy = importlib.import_module("kernels_pallas.copy_blocks")
_gmm = importlib.import_module("kernels_pallas.grouped_matmul")

IMPLS = ("auto", "pallas", "reference")
GPU_BACKENDS = ("gpu", "cuda", "rocm")


def resolve(impl: str) -> tuple[bool, bool]:
    """``(use the Pallas kernel, interpret it)`` for ``impl`` on this backend."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    on_gpu = jax.default_backend() in GPU_BACKENDS
    if impl == "reference":
        return False, False
    if impl == "pallas":
        return True, not on_gpu
    return on_gpu, False


def _on_host(x) -> bool:
    return jax.typeof(x).memory_space == jax.memory.Space.Host


def _to_device(planes: dict) -> dict:
    """Host planes moved to the device (for XLA gathers / the interpreter); device planes as they are."""
    return {n: jax.device_put(v, jax.memory.Space.Device) if _on_host(v) else v for n, v in planes.items()}


GATHER_BLOCK_ROWS = 16


def gather_rows(planes: dict, plane_of_lane, positions, *, kv_format: str, out_dtype, impl: str):
    """Rows at ``positions [S, M]`` of plane ``plane_of_lane[s]`` of ``planes`` (each ``[P, N, W]``), dequantised
    to ``out_dtype``: ``(latent [S, M, 512], rope [S, M, 64])``."""
    use_pallas, interpret = resolve(impl)
    if not use_pallas or interpret:
        planes = _to_device(planes)
    if not use_pallas:
        return _gather.gather_rows_reference(planes, plane_of_lane, positions, kv_format=kv_format,
                                             out_dtype=out_dtype)
    S, M = positions.shape
    pad = (-M) % GATHER_BLOCK_ROWS
    if pad:  # row 0 always exists; padded rows are sliced off below
        positions = jnp.pad(positions, ((0, 0), (0, pad)))
    latent, rope = _gather.gather_rows(planes, plane_of_lane, positions, kv_format=kv_format, out_dtype=out_dtype,
                                       block_rows=GATHER_BLOCK_ROWS, interpret=interpret)
    return latent[:, :M], rope[:, :M]


def indexer_scores(q, weights, keys, key_plane, query_positions, key_scale=None, *, softmax_scale: float,
                   precision: str, impl: str, key_dtype=None):
    """DSA indexer scores ``f32[S, T, N]`` of lane s's queries against key plane ``key_plane[s]`` of ``keys``
    (``[P, N, D]``; fp8 keys with ``key_scale [P, N]``; the bits of ``key_dtype`` values if given) at
    ``precision``."""
    use_pallas, interpret = resolve(impl)
    if not use_pallas or interpret:
        keys = _to_device({"keys": keys})["keys"]
    fn = _indexer.indexer_scores if use_pallas else _indexer.indexer_scores_reference
    kw = dict(interpret=interpret) if use_pallas else {}
    return fn(q, weights, keys, key_plane, query_positions, key_scale, softmax_scale=softmax_scale,
              precision=precision, key_dtype=None if key_dtype is None else np.dtype(key_dtype), **kw)


def topk_positions(scores, k: int, query_positions, *, impl: str):
    """Positions of the k highest scores per row, ascending (``int32[S, T, k]``); rows are causal at
    ``query_positions [S, T]``, which bounds the kernel's work by the live history."""
    use_pallas, interpret = resolve(impl)
    if not use_pallas:
        return _indexer.topk_positions_reference(scores, k)
    return _indexer.topk_positions(scores, k, query_positions, interpret=interpret)


def hot_gather(source, row, ring: dict, hot: dict, host: dict, *, kv_format: str, out_dtype, impl: str):
    """Entries ``[E]`` from the ring / hot cache / host history (offload mode's gather): ``(latent [E, 512], rope
    [E, 64], packed {plane: [E, W]})``."""
    use_pallas, interpret = resolve(impl)
    E = source.shape[0]
    block_rows = _hot.DEFAULT_BLOCK_ROWS  # the kernel's launch shape (see there)
    pad = (-E) % block_rows
    if pad:  # padded entries read ring row 0, which always exists, and are sliced off below
        source = jnp.pad(source, (0, pad))
        row = jnp.pad(row, (0, pad))
    kw = dict(kv_format=kv_format, out_dtype=out_dtype, block_rows=block_rows)
    if use_pallas and not interpret:
        latent, rope, packed = _hot.hot_gather(source, row, ring, hot, host, **kw)
    else:
        ring, hot, host = _to_device(ring), _to_device(hot), _to_device(host)
        fn = _hot.hot_gather if use_pallas else _hot.hot_gather_reference
        latent, rope, packed = fn(source, row, ring, hot, host, interpret=interpret, **kw)
    return latent[:E], rope[:E], {n: v[:E] for n, v in packed.items()}


FILL_BLOCK_ROWS = 16


def fill_rows(hot: dict, rows: tuple, entry, victim, n_fill, lane_slot, *, layers: tuple, sessions: int,
              hot_rows: int, impl: str):
    """Copy ``n_fill`` gathered rows per layer and lane into their victim slots of session slot ``lane_slot[b]``
    (offload fill), in place. ``n_fill`` must not exceed F, the fills ``entry`` lists (``fill_round``'s never
    does): F is padded here to a multiple of the block, and a larger count would copy the padding (entry 0 into
    slot 0)."""
    use_pallas, interpret = resolve(impl)
    F = entry.shape[2]
    pad = (-F) % FILL_BLOCK_ROWS
    if pad:  # padded fills lie past n_fill: never copied
        entry = jnp.pad(entry, ((0, 0), (0, 0), (0, pad)))
        victim = jnp.pad(victim, ((0, 0), (0, 0), (0, pad)))
    fn = _fill.fill_rows if use_pallas else _fill.fill_rows_reference
    return fn(hot, tuple(rows), entry, victim, n_fill, lane_slot, layers=tuple(layers), sessions=sessions,
              hot_rows=hot_rows, block_rows=FILL_BLOCK_ROWS, interpret=interpret)


# One program holds a whole round of a (layer, lane) in registers: past this many positions (prefill-sized rounds)
# the reference, whose sort and scans XLA tiles, takes over.
MAX_KERNEL_ROUND_POSITIONS = 16384


def fill_round(maps: dict, rounds: tuple, lane_slot, lane_active, *, layers: tuple, hot_rows: int, distinct: bool,
               max_repeats: int, impl: str, victim_keys=None):
    """The offload fill's bookkeeping for one round per layer and lane: ``(maps, entry, victim, n_fill)`` (see
    ``kernels_pallas.fill_round``). ``distinct=False`` rounds may repeat a position up to ``max_repeats`` times.
    ``victim_keys``: another policy's victim order (LFU), which only the jnp reference implements."""
    use_pallas, interpret = resolve(impl)
    M = rounds[0]["pos"].shape[1]
    if victim_keys is not None:
        return _fill_round.fill_round_reference(maps, tuple(rounds), lane_slot, lane_active, layers=tuple(layers),
                                                hot_rows=hot_rows, distinct=distinct, max_repeats=max_repeats,
                                                victim_keys=victim_keys)
    kernel = use_pallas and M <= MAX_KERNEL_ROUND_POSITIONS
    fn = _fill_round.fill_round if kernel else _fill_round.fill_round_reference
    return fn(maps, tuple(rounds), lane_slot, lane_active, layers=tuple(layers), hot_rows=hot_rows,
              distinct=distinct, max_repeats=max_repeats, interpret=interpret)


COPY_BLOCK_ROWS = 16


def copy_blocks(dst: dict, src: dict, src_start, dst_start, count, *, block_size: int, impl: str) -> dict:
    """``dst[p][dst_start[i] + r] = src[p][src_start[i] + r]`` for ``r < min(count[i], block_size)``, in place
    (``dst`` donated); either side may live in ``pinned_host`` memory. Returns the new ``dst``."""
    use_pallas, interpret = resolve(impl)
    kw = dict(block_size=block_size, block_rows=min(COPY_BLOCK_ROWS, block_size))
    on_host = {n: _on_host(v) for n, v in dst.items()}
    if use_pallas and not interpret:
        out = _copy.copy_blocks(dst, src, src_start, dst_start, count, **kw)
    else:
        fn = _copy.copy_blocks if use_pallas else _copy.copy_blocks_reference
        out = fn(_to_device(dst), _to_device(src), src_start, dst_start, count, interpret=interpret, **kw)
    # pallas_call types every output as device memory, an aliased pinned_host buffer too: the transfer back says
    # where the result lives. On the kernel path it is the input's own buffer, so XLA has nothing to move.
    return {n: jax.device_put(v, jax.memory.Space.Host) if on_host[n] else v for n, v in out.items()}


def grouped_matmul(x, w, group_sizes, w_scale=None, *, impl: str):
    """MoE experts: rows of ``x [M, K]`` sorted by group times their group's ``w [G, K, N]`` (``ragged_dot``),
    reading only the groups that have rows; FP8 ``w`` with its 128 x 128 block scales ``w_scale``."""
    use_pallas, interpret = resolve(impl)
    if not use_pallas:
        return _gmm.grouped_matmul_reference(x, w, group_sizes, w_scale)
    return _gmm.grouped_matmul(x, w, group_sizes, w_scale, interpret=interpret)


def grouped_swiglu(x, w_gate, w_up, group_sizes, gate_scale=None, up_scale=None, *, impl: str):
    """MoE experts' SwiGLU ``silu(x @ w_gate) * (x @ w_up)`` over rows sorted by group, in one kernel launch: what
    ``silu(grouped_matmul(gate)) * grouped_matmul(up)`` computes."""
    use_pallas, interpret = resolve(impl)
    if not use_pallas:
        return _gmm.grouped_swiglu_reference(x, w_gate, w_up, group_sizes, gate_scale, up_scale)
    return _gmm.grouped_swiglu(x, w_gate, w_up, group_sizes, gate_scale, up_scale, interpret=interpret)
