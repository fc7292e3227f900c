"""Checks and times the Pallas kernels against their references.

GPU:  python -m experiments.bench_kernels --out results.json
CPU smoke test (tiny sizes, interpreted kernels): add --tiny.

Each op: random data at GLM-5 sizes, kernel == reference (bit-exact for gather and
top-k, allclose for scores), then the median of ``--iters`` timed calls after
warm-up for both. Prints a table and writes the rows as JSON to --out.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from glm53.provenance import provenance
from kernels_pallas import kv_formats
from kernels_pallas.gather_rows import gather_rows, gather_rows_reference
from kernels_pallas.indexer_topk import (
    BLOCK_TOTALS,
    indexer_scores,
    indexer_scores_reference,
    topk_positions,
    topk_positions_reference,
)


def _positive(text: str) -> int:
    """argparse's type for a count >= 1 (0 timed calls would report the median of nothing as a time)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return value


def _median_ms(fn, iters: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _random_planes(fmt_name: str, S: int, N: int, seed: int):
    """Random planes built directly (packing 1M rows would dominate the run)."""
    fmt = kv_formats.get_format(fmt_name)
    keys = jax.random.split(jax.random.key(seed), 3)
    planes = {}
    for key, (name, (shape, dtype)) in zip(keys, fmt.plane_shapes(S, N, values=True).items()):
        if name == "latent" and dtype == jnp.int8:
            values = jax.random.randint(key, shape, -127, 128, jnp.int32).astype(dtype)
        elif name == "scale":
            values = jax.random.uniform(key, shape, jnp.float32, 1e-3, 1.0).astype(dtype)
        else:
            values = jax.random.normal(key, shape, jnp.float32).astype(dtype)
        planes[name] = kv_formats.to_stored(values)  # as the caches hold them
    return planes


def bench_gather(N, M, fmt, interpret, iters):
    S = 1
    planes = _random_planes(fmt, S, N, seed=0)
    plane_of_lane = jnp.zeros((S,), jnp.int32)
    pos = jnp.sort(jax.random.randint(jax.random.key(1), (S, M), 0, N), axis=-1)
    kw = dict(kv_format=fmt, out_dtype=jnp.bfloat16, block_rows=16)
    kern = lambda: gather_rows(planes, plane_of_lane, pos, interpret=interpret, **kw)
    ref = lambda: gather_rows_reference(planes, plane_of_lane, pos, **kw)
    ok = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(kern(), ref()))
    return dict(
        op="gather_rows",
        shape=f"N={N} M={M} {fmt}",
        match=ok,
        kernel_ms=_median_ms(kern, iters),
        reference_ms=_median_ms(ref, iters),
    )


def bench_indexer(N, T, k, interpret, iters, Hi=32, D=128, block_keys=128):
    S = 1
    ks = jax.random.split(jax.random.key(2), 3)
    q = jax.random.normal(ks[0], (S, T, Hi, D), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(ks[1], (S, T, Hi), jnp.float32)
    keys = jax.random.normal(ks[2], (S, N, D), jnp.float32).astype(jnp.bfloat16)
    key_plane = jnp.zeros((S,), jnp.int32)
    qpos = jnp.full((S, T), N - T, jnp.int32) + jnp.arange(T, dtype=jnp.int32)
    kw = dict(softmax_scale=D**-0.5, block_keys=block_keys)
    kern = lambda: indexer_scores(q, w, keys, key_plane, qpos, interpret=interpret, **kw)
    ref = lambda: indexer_scores_reference(q, w, keys, key_plane, qpos, **kw)
    a, b = np.asarray(kern()), np.asarray(ref())
    fin = np.isfinite(b)
    ok = bool(np.array_equal(np.isfinite(a), fin) and np.allclose(a[fin], b[fin], rtol=1e-5, atol=1e-4))
    rows = [
        dict(
            op="indexer_scores",
            shape=f"N={N} T={T} Hi={Hi} D={D}",
            match=ok,
            max_abs_err=float(np.max(np.abs(a[fin] - b[fin]))),
            kernel_ms=_median_ms(kern, iters),
            reference_ms=_median_ms(ref, iters),
        )
    ]
    # Select on the kernel's scores for both, so selection equality is exact.
    scores = jnp.asarray(a)
    ref_k = lambda: topk_positions_reference(scores, k)
    want = np.asarray(ref_k())
    reference_ms = _median_ms(ref_k, iters)
    # Both ways of summing the blocks' counts (kernels_pallas.indexer_topk.BLOCK_TOTALS): the decode step uses the
    # faster, once this has measured it on the GPU.
    for block_totals in BLOCK_TOTALS:
        kern_k = functools.partial(topk_positions, scores, k, block_totals=block_totals, interpret=interpret)
        rows.append(
            dict(
                op=f"topk_positions[{block_totals}]",
                shape=f"N={N} T={T} k={k}",
                match=bool(np.array_equal(np.asarray(kern_k()), want)),
                kernel_ms=_median_ms(kern_k, iters),
                reference_ms=reference_ms,
            )
        )
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes, interpreted")
    parser.add_argument("--iters", type=_positive, default=20, help="timed calls per kernel (median reported)")
    args = parser.parse_args(argv)

    interpret = args.tiny or jax.default_backend() == "cpu"
    if args.tiny:
        sizes, M, k, iters = [256], 32, 64, 2
    else:
        sizes, M, k, iters = [65_536, 1_048_576], 2_048, 2_048, args.iters
    rows = []
    for N in sizes:
        for fmt in ("q8g64", "bf16"):
            rows.append(bench_gather(N, M, fmt, interpret, iters))
        for T in (1, 4):
            rows.extend(
                bench_indexer(
                    N,
                    T,
                    k,
                    interpret,
                    iters,
                    Hi=8 if args.tiny else 32,
                    D=32 if args.tiny else 128,
                    block_keys=64 if args.tiny else 128,
                )
            )

    print(f"{'op':<24} {'shape':<32} {'match':<6} {'kernel ms':>10} {'ref ms':>10}")
    for r in rows:
        print(
            f"{r['op']:<24} {r['shape']:<32} {str(r['match']):<6} "
            f"{r['kernel_ms']:>10.3f} {r['reference_ms']:>10.3f}"
        )
    if args.out:
        meta = dict(python=platform.python_version(), interpret=interpret, iters=iters, **provenance())
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=2)
    if not all(r["match"] for r in rows):
        raise SystemExit("kernel and reference disagree")


if __name__ == "__main__":
    main()
