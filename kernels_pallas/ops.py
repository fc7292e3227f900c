"""The ops the model calls, each choosing the Pallas kernel or its jnp reference by backend.

On GPU backends (CUDA, ROCm) the Pallas kernels run (Triton lowering); on CPU the jnp references run, because
Pallas on CPU only exists as the interpreter, which is orders of magnitude slower. The choice is made once per
trace from ``jax.default_backend()`` — never from environment variables — and the tests pin kernel == reference
so either choice computes the same function. ``force_impl`` exists for tests that run the kernels (interpreted)
inside the whole model.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp

import importlib

# The package re-exports functions named like these modules, so fetch the modules themselves.
_gather = importlib.import_module("kernels_pallas.gather_rows")
_hot = importlib.import_module("kernels_pallas.hot_gather")
_indexer = importlib.import_module("kernels_pallas.indexer_topk")
_fill = importlib.import_module("kernels_pallas.fill_rows")
_fill_round = importlib.import_module("kernels_pallas.fill_round")

_FORCED: str | None = None
GATHER_BLOCK_ROWS = 16


@contextlib.contextmanager
def force_impl(impl: str | None):
    """Within the block, trace ops with ``"pallas"`` (interpreted on CPU) or ``"reference"``."""
    global _FORCED
    if impl not in (None, "pallas", "reference"):
        raise ValueError(f"impl must be 'pallas', 'reference' or None, got {impl!r}")
    old, _FORCED = _FORCED, impl
    try:
        yield
    finally:
        _FORCED = old


def _impl() -> tuple[bool, bool]:
    """(use the Pallas kernel, interpret it)."""
    on_gpu = jax.default_backend() in ("gpu", "cuda", "rocm")
    if _FORCED == "reference":
        return False, False
    if _FORCED == "pallas":
        return True, not on_gpu
    return on_gpu, False


def gather_rows(planes: dict, positions: jax.Array, *, kv_format: str, out_dtype, first_plane: int = 0):
    """Rows at ``positions [S, M]`` of planes ``first_plane + s`` of ``planes`` (each ``[P, N, W]``), dequantised
    to ``out_dtype``."""
    use_pallas, interpret = _impl()
    if not use_pallas:
        return _gather.gather_rows_reference(planes, positions, kv_format=kv_format, out_dtype=out_dtype,
                                             first_plane=first_plane)
    S, M = positions.shape
    pad = (-M) % GATHER_BLOCK_ROWS
    if pad:  # row 0 always exists; padded rows are sliced off below
        positions = jnp.pad(positions, ((0, 0), (0, pad)))
    latent, rope = _gather.gather_rows(planes, positions, kv_format=kv_format, out_dtype=out_dtype,
                                       block_rows=GATHER_BLOCK_ROWS, interpret=interpret, first_plane=first_plane)
    return latent[:, :M], rope[:, :M]


# The indexer kernels are built for decode and MTP verify (a few query rows against every key); prefill chunks of
# hundreds of queries are a dense matmul that XLA tiles better, so they take the reference path.
MAX_KERNEL_QUERIES = 8


def indexer_scores(q, weights, keys, query_positions, *, softmax_scale: float):
    use_pallas, interpret = _impl()
    if not use_pallas or q.shape[1] > MAX_KERNEL_QUERIES:
        return _indexer.indexer_scores_reference(q, weights, keys, query_positions, softmax_scale=softmax_scale)
    return _indexer.indexer_scores(q, weights, keys, query_positions, softmax_scale=softmax_scale,
                                   interpret=interpret)


def topk_positions(scores, k: int):
    use_pallas, interpret = _impl()
    if not use_pallas or scores.shape[1] > MAX_KERNEL_QUERIES:
        return _indexer.topk_positions_reference(scores, k)
    return _indexer.topk_positions(scores, k, interpret=interpret)


def hot_gather(source, row, ring: dict, hot: dict, host: dict, *, kv_format: str, out_dtype):
    """Entries ``[E]`` from the ring / hot cache / host history (offload mode's gather): ``(latent [E, 512], rope
    [E, 64], packed {plane: [E, W]})``."""
    use_pallas, interpret = _impl()
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
        # XLA (and the Pallas interpreter, which lowers to XLA gathers) cannot read pinned_host operands: bring the
        # host planes to the device first. On a CPU both memories are host RAM; GPUs take the kernel path above.
        host = {n: jax.device_put(v, jax.memory.Space.Device) for n, v in host.items()}
        if use_pallas:
            latent, rope, packed = _hot.hot_gather(source, row, ring, hot, host, interpret=True, **kw)
        else:
            latent, rope, packed = _hot.hot_gather_reference(source, row, ring, hot, host, **kw)
    return latent[:E], rope[:E], {n: v[:E] for n, v in packed.items()}


FILL_BLOCK_ROWS = 16


def fill_rows(hot: dict, rows: tuple, entry, victim, n_fill, *, layers: tuple, sessions: int, hot_rows: int):
    """Copy ``n_fill`` gathered rows per layer and session into their victim slots (offload fill), in place."""
    use_pallas, interpret = _impl()
    F = entry.shape[2]
    pad = (-F) % FILL_BLOCK_ROWS
    if pad:  # padded fills lie past n_fill: never copied
        entry = jnp.pad(entry, ((0, 0), (0, 0), (0, pad)))
        victim = jnp.pad(victim, ((0, 0), (0, 0), (0, pad)))
    fn = _fill.fill_rows if use_pallas else _fill.fill_rows_reference
    return fn(hot, tuple(rows), entry, victim, n_fill, layers=tuple(layers), sessions=sessions, hot_rows=hot_rows,
              block_rows=FILL_BLOCK_ROWS, interpret=interpret)


def fill_round(maps: dict, rounds: tuple, *, layers: tuple, hot_rows: int, distinct: bool):
    """The offload fill's bookkeeping for one round per layer: ``(maps, entry, victim, n_fill)`` (see
    ``kernels_pallas.fill_round``). The kernel takes decode rounds; rounds with repeated positions (prefill chunks)
    take the reference, whose deduplication needs a sort."""
    use_pallas, interpret = _impl()
    fn = _fill_round.fill_round if use_pallas and distinct else _fill_round.fill_round_reference
    return fn(maps, tuple(rounds), layers=tuple(layers), hot_rows=hot_rows, distinct=distinct, interpret=interpret)
