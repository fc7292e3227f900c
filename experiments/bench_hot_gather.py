"""Hot-gather kernel benchmark: all hits, 50% hits, all misses, against the device-only gather and the zero-copy
host-read bandwidth measured in the same run.

    python -m experiments.bench_hot_gather --out=experiments/results/hot_gather.json
    python -m experiments.bench_hot_gather --tiny   # CPU smoke run (interpreted kernels, timings meaningless)

Times are device times from a profiler trace by default (``--timer=profile``): the kernels' own time, as a decode
step pays it.

Every timed configuration is first checked bit-for-bit against the jnp reference.
"""

import functools
import itertools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from experiments import cli
from kernels_pallas import kv_formats
from glm53.provenance import provenance
import importlib

hg = importlib.import_module("kernels_pallas.hot_gather")

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "", "write the results JSON here")
flags.DEFINE_bool("tiny", False, "small sizes for a CPU smoke run")
flags.DEFINE_string("kv_format", "q8g64", "row format")
flags.DEFINE_integer("iters", 50, "timed calls per case (median reported)", lower_bound=1)
flags.DEFINE_bool("sweep", False, "also time every (block_rows, num_warps) launch shape at all hits / all misses "
                  "and at each --decode_cases case")
flags.DEFINE_list("sweep_block_rows", ["4", "8", "16", "32"], "--sweep: rows per program")
flags.DEFINE_list("sweep_num_warps", ["1", "2", "4", "8"], "--sweep: warps per program")
flags.DEFINE_list("insitu", ["10:2048:50000:32768:0.99"],
                    "a decode step's layer laid out as the engine lays it out, lanes:K:history:hot_rows:hits (--tiny "
                    "shrinks it): each lane selects K sorted positions of its own history (a working set, as local99); "
                    "its hot cache holds them in slots handed out as misses arrived, so slot order is random against "
                    "position order; misses read the lane's own host rows. Timed as the step orders the entries, with "
                    "the same entries' slots sorted by position, and beside the resident gather of the same positions; "
                    "several cases are named by their hit fraction")
flags.DEFINE_integer("host_pad_rows", 0, "zero rows appended to the host planes, never addressed: the engine's pool "
                     "at 10 x 50K (~4.5M rows) passes 2**32 bytes, where the kernel addresses the host plane in 64 "
                     "bits (kernels_pallas.hot_gather: addressing); 8000000 puts this bench's host plane there too")
flags.DEFINE_enum("timer", "profile", ["profile", "loop"],
                  "profile: each call's device time from a profiler trace (the kernels' own time, what the decode "
                  "step pays); loop: wall time of calls in a jitted fori_loop (before 2026-12: an XLA while loop on "
                  "the GPU adds a host round trip per iteration, ~20-30 us, so sub-30-us kernels all read alike)")
flags.DEFINE_list("decode_cases", ["20480:0.99"], "more cases, rows:hit_fraction, each beside the resident gather of "
                  "as many rows: the default is a 10-session decode step's layer (10 x 2,048 rows, 1% misses); "
                  "--tiny caps the rows at half the history")


def timeit(fn, varying, fixed, iters):
    """Seconds per call of ``fn(*varying[i], *fixed)`` by ``--timer``."""
    return (profile_time if FLAGS.timer == "profile" else loop_time)(fn, varying, fixed, iters)


def profile_time(fn, varying, fixed, iters):
    """Device seconds per call of ``fn(*varying[i], *fixed)``: the summed duration of the device events (kernels,
    copies) of ``iters`` calls in a profiler trace, rotating through the ``varying`` index sets, over ``iters``.
    The host's dispatch and launch gaps are not counted: this is what the kernel costs inside a decode step,
    where the device runs its kernels back to back."""
    import tempfile
    from experiments import trace_util
    jitted = jax.jit(fn)
    jax.block_until_ready([jitted(*v, *fixed) for v in varying])
    with tempfile.TemporaryDirectory() as logdir:
        with jax.profiler.trace(logdir, profiler_options=trace_util.trace_options()):
            outs = [jitted(*varying[i % len(varying)], *fixed) for i in range(iters)]
            jax.block_until_ready(outs)
        events = trace_util.device_events(trace_util.find_xplane(logdir))
    if not events:
        raise RuntimeError("the profiler trace holds no device events")
    return sum(duration for _, _, duration, _ in events) / 1e9 / iters


def loop_time(fn, varying, fixed, iters):
    """Seconds per call of ``fn(*varying[i], *fixed)`` on the device: ``iters`` calls run inside one jitted loop
    (so Python dispatch, ~0.05 ms a call, is not counted), rotating through the ``varying`` index sets so calls do
    not reuse a warm cache; the planes (``fixed``) are arguments, never copied. Median of 5 loops / ``iters``."""
    stacked = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *varying)
    n_sets = len(varying)

    @jax.jit
    def loop(stacked, fixed):
        def body(i, acc):
            args = jax.tree_util.tree_map(lambda x: x[i % n_sets], stacked)
            out = fn(*args, *fixed)
            # A data dependence on every output keeps each call alive without extra work worth measuring.
            return acc + sum(jnp.ravel(v)[0].astype(jnp.float32) for v in jax.tree_util.tree_leaves(out))
        return jax.lax.fori_loop(0, iters, body, jnp.float32(0))

    jax.block_until_ready(loop(stacked, fixed))
    times = []
    for _ in range(5):
        t = time.perf_counter()
        jax.block_until_ready(loop(stacked, fixed))
        times.append(time.perf_counter() - t)
    return float(np.median(times)) / iters


def wall_time(fn, args, iters):
    """Median wall seconds per call (for a bulk copy of ~13 ms, dispatch is negligible)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def main(_):
    on_gpu = jax.default_backend() == "gpu"
    interpret = not on_gpu
    fmt = kv_formats.get_format(FLAGS.kv_format)
    n_hist, H, R, M, big = ((1 << 20), 32768, 2048, 2048, 65536) if not FLAGS.tiny else (4096, 256, 64, 64, 512)
    rng = np.random.default_rng(0)
    dev = jax.devices()[0]
    host_sh = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")

    def planes(n):
        lat = rng.normal(size=(n, 512)).astype(np.float32)
        rope = rng.normal(size=(n, 64)).astype(np.float32)
        return {k: np.asarray(v) for k, v in kv_formats.pack(fmt, jnp.asarray(lat), jnp.asarray(rope)).items()}

    hist_np = planes(n_hist)
    padded = {k: np.concatenate([v, np.zeros((FLAGS.host_pad_rows,) + v.shape[1:], v.dtype)])
              for k, v in hist_np.items()} if FLAGS.host_pad_rows else hist_np
    host = {k: jax.device_put(v, host_sh) for k, v in padded.items()}
    host_on_device = {k: jnp.asarray(v) for k, v in hist_np.items()}
    hot = {k: jnp.asarray(v) for k, v in planes(H).items()}
    ring = {k: jnp.asarray(v) for k, v in planes(R).items()}
    assert all(v.sharding.memory_kind == "pinned_host" for v in host.values())
    if not on_gpu:  # the Pallas interpreter cannot read pinned_host operands (XLA gathers): smoke-test only
        host = {k: jnp.asarray(v) for k, v in padded.items()}

    def kernel(s, r, ring, hot, host, block_rows=hg.DEFAULT_BLOCK_ROWS, num_warps=hg.DEFAULT_NUM_WARPS):
        return hg.hot_gather(s, r, ring, hot, host, kv_format=fmt.name, out_dtype=jnp.bfloat16,
                             block_rows=block_rows, num_warps=num_warps, interpret=interpret)

    reference = jax.jit(lambda *a: hg.hot_gather_reference(*a, kv_format=fmt.name, out_dtype=jnp.bfloat16))

    def inputs(hit_frac, n, sets=4):
        out = []
        for _ in range(sets):
            hit = rng.random(n) < hit_frac
            src = np.where(hit, hg.HOT, hg.HOST).astype(np.int32)
            row = np.where(hit, rng.integers(0, H, n), np.sort(rng.choice(n_hist, n, replace=False)))
            out.append((jnp.asarray(src), jnp.asarray(row.astype(np.int32))))
        return out

    results = {"backend": jax.default_backend(), "device": dev.device_kind, "jax": jax.__version__,
               "host_plane_rows": n_hist + FLAGS.host_pad_rows,
               "kv_format": fmt.name, "row_bytes": fmt.bytes_per_row, "history_rows": n_hist, "hot_rows": H,
               "rows_per_gather": M, "cases": {}}
    def identical(got, want, source) -> bool:
        """The kernel's outputs equal the reference's bit for bit (packed rows where defined: at misses)."""
        got, want = (x[:2] + (hg.packed_at_misses(x[2], source),) for x in (got, want))
        return all(np.array_equal(np.asarray(g), np.asarray(w))
                   for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)))

    def checked_time(frac, n):
        """Seconds per gather of ``n`` rows at hit fraction ``frac``, and whether the kernel equals the reference."""
        sets = inputs(frac, n)
        equal = identical(kernel(*sets[0], ring, hot, host), reference(*sets[0], ring, hot, host_on_device),
                          sets[0][0])
        return timeit(kernel, sets, (ring, hot, host), FLAGS.iters), equal

    for name, frac in (("all_hits", 1.0), ("half_hits", 0.5), ("all_misses", 0.0)):
        t, equal = checked_time(frac, M)
        results["cases"][name] = {"hit_fraction": frac, "ms": t * 1e3, "bit_identical_to_reference": equal,
                                  "host_GBps": (1 - frac) * M * fmt.bytes_per_row / t / 1e9}
    # The decode step's shape: many rows, few misses (the 10-session profile's hot gather took 35.6 us a layer
    # against the resident gather's 11.4: profile_decode_50k_b10.json), beside the resident gather of as many rows.
    from kernels_pallas.gather_rows import gather_rows
    res_planes = {k: v[None] for k, v in host_on_device.items()}

    def resident(pos, planes):
        pos = pos if pos.ndim == 2 else pos[None]
        return gather_rows(planes, jnp.arange(pos.shape[0], dtype=jnp.int32), pos, kv_format=fmt.name,
                           out_dtype=jnp.bfloat16, interpret=interpret)

    def decode_case(case: str) -> tuple[str, int, float]:
        rows, frac = case.split(":")
        rows, frac = min(int(rows), n_hist // 2) if FLAGS.tiny else int(rows), float(frac)
        rows -= rows % max(32, hg.DEFAULT_BLOCK_ROWS)  # every swept launch shape divides it
        return f"rows{rows}_hits{frac:g}", rows, frac

    def insitu_case_frac(spec: str) -> float:
        return float(spec.split(":")[-1])

    def insitu_case(spec: str) -> dict:
        """``--insitu``: the kernel's inputs in the order the step builds them (lane by lane, positions sorted) and
        with each lane's slots sorted by position, a hot plane of ``lanes x hot_rows``, and the resident gather's
        positions and ``[lanes, history, W]`` planes."""
        lanes, K, hist, hot_rows, frac = spec.split(":")
        lanes, K, hist, hot_rows, frac = int(lanes), int(K), int(hist), int(hot_rows), float(frac)
        if FLAGS.tiny:
            lanes, K, hist, hot_rows = 2, 64, 1024, 256
        if lanes * hist > n_hist or K > min(hist, hot_rows) or (lanes * K) % 32:
            raise ValueError(f"--insitu={spec}: lanes x history must fit the {n_hist:,}-row host plane, K "
                             "the history and the hot rows, and lanes x K be a multiple of 32")
        hot_planes = {k: jnp.asarray(v) for k, v in planes(lanes * hot_rows).items()}
        sets = {"insitu_step_order": [], "insitu_slots_by_position": []}
        positions = []
        for _ in range(4):
            pos = np.stack([np.sort(rng.choice(hist, K, replace=False)) for _ in range(lanes)])  # [lanes, K]
            hit = rng.random((lanes, K)) < frac
            slots = np.stack([rng.choice(hot_rows, K, replace=False) for _ in range(lanes)])
            base_hot = (np.arange(lanes) * hot_rows)[:, None]
            host_row = (np.arange(lanes) * hist)[:, None] + pos
            src = np.where(hit, hg.HOT, hg.HOST).astype(np.int32).reshape(-1)
            for name, s_ in (("insitu_step_order", slots), ("insitu_slots_by_position", np.sort(slots, axis=1))):
                row = np.where(hit, base_hot + s_, host_row).astype(np.int32).reshape(-1)
                sets[name].append((jnp.asarray(src), jnp.asarray(row)))
            positions.append((jnp.asarray(pos.astype(np.int32)),))
        res_planes = {k: v[: lanes * hist].reshape(lanes, hist, v.shape[-1]) for k, v in host_on_device.items()}
        return {"sets": sets, "hot": hot_planes, "positions": positions, "resident_planes": res_planes,
                "shape": {"lanes": lanes, "K": K, "history": hist, "hot_rows": hot_rows, "hit_fraction": frac}}

    for case in FLAGS.decode_cases:
        _, rows, frac = decode_case(case)
        t, equal = checked_time(frac, rows)
        positions = [(jnp.asarray(np.sort(rng.choice(n_hist, rows, replace=False)).astype(np.int32)),)
                     for _ in range(4)]
        t_res = timeit(resident, positions, (res_planes,), FLAGS.iters)
        results["cases"][decode_case(case)[0]] = {
            "rows": rows, "hit_fraction": frac, "ms": t * 1e3, "bit_identical_to_reference": equal,
            "resident_gather_rows_dequant_ms": t_res * 1e3, "over_resident_ms": (t - t_res) * 1e3}
    # The first --insitu case keeps the names earlier results used; the others are named by their hit fraction.
    insitu_cases = {("" if i == 0 else f"_hits{insitu_case_frac(spec):g}"): insitu_case(spec)
                    for i, spec in enumerate(FLAGS.insitu)}
    for suffix, insitu in insitu_cases.items():
        for name, sets in insitu["sets"].items():
            equal = identical(kernel(*sets[0], ring, insitu["hot"], host),
                              reference(*sets[0], ring, insitu["hot"], host_on_device), sets[0][0])
            t = timeit(kernel, sets, (ring, insitu["hot"], host), FLAGS.iters)
            results["cases"][name + suffix] = {"ms": t * 1e3, "bit_identical_to_reference": equal,
                                               **insitu["shape"]}
        t_res = timeit(resident, insitu["positions"], (insitu["resident_planes"],), FLAGS.iters)
        results["cases"]["insitu_resident_gather_rows_dequant" + suffix] = {"ms": t_res * 1e3, **insitu["shape"]}
    # Device-only baselines: the same kernel with the history on the device, and the resident gather (+dequant).
    sets = inputs(0.0, M)
    t_dev = timeit(kernel, sets, (ring, hot, host_on_device), FLAGS.iters)
    results["cases"]["device_only_same_kernel"] = {"ms": t_dev * 1e3}
    t_res = timeit(resident, [(r,) for _, r in sets], (res_planes,), FLAGS.iters)
    results["cases"]["resident_gather_rows_dequant"] = {"ms": t_res * 1e3}
    # Zero-copy bandwidth ceiling of this machine: the same miss path with many rows in flight, and a bulk DMA.
    # The ceiling is the faster of the default launch shape and 16 rows x 4 warps (the shape it was measured with
    # before), so a launch shape that is slow with many rows cannot lower the bar the 2,048-row case is judged by.
    sets_big = inputs(0.0, big, sets=2)
    t_big = min(timeit(functools.partial(kernel, block_rows=b, num_warps=w), sets_big, (ring, hot, host),
                       max(5, FLAGS.iters // 5)) for b, w in {(hg.DEFAULT_BLOCK_ROWS, hg.DEFAULT_NUM_WARPS),
                                                              (16, 4)})
    zero_copy = big * fmt.bytes_per_row / t_big / 1e9
    bulk = jax.jit(lambda h: {k: jax.device_put(v, jax.memory.Space.Device) for k, v in h.items()})
    t_bulk = wall_time(bulk, (host,), max(5, FLAGS.iters // 5))
    results["zero_copy_GBps"] = zero_copy
    results["zero_copy_rows"] = big
    results["bulk_copy_GBps"] = n_hist * fmt.bytes_per_row / t_bulk / 1e9
    miss = results["cases"]["all_misses"]
    results["all_misses_fraction_of_zero_copy"] = miss["host_GBps"] / zero_copy
    if FLAGS.sweep:
        # Misses are latency-bound over PCIe at 2,048 rows: how many rows each program keeps in flight (block_rows,
        # with more programs for fewer rows) and how many warps issue them decide the bandwidth reached.
        # At the decode step's shape (many rows, few misses) bandwidth matters as well as latency, so the shape
        # chosen at 2,048 rows need not be the best there: each decode case is timed with every shape too.
        sweep = []
        miss_sets, hit_sets = inputs(0.0, M), inputs(1.0, M)
        want = reference(*miss_sets[0], ring, hot, host_on_device)
        decode_sets = {}
        for case in FLAGS.decode_cases:
            name, rows, frac = decode_case(case)
            sets = inputs(frac, rows)
            decode_sets[name] = (sets, hot, reference(*sets[0], ring, hot, host_on_device))
        for suffix, insitu in insitu_cases.items():
            sets = insitu["sets"]["insitu_step_order"]
            decode_sets["insitu_step_order" + suffix] = (sets, insitu["hot"],
                                                         reference(*sets[0], ring, insitu["hot"], host_on_device))
        for block_rows, num_warps in itertools.product(map(int, FLAGS.sweep_block_rows),
                                                       map(int, FLAGS.sweep_num_warps)):
            fn = functools.partial(kernel, block_rows=block_rows, num_warps=num_warps)
            equal = identical(fn(*miss_sets[0], ring, hot, host), want, miss_sets[0][0])
            t_miss = timeit(fn, miss_sets, (ring, hot, host), FLAGS.iters)
            t_hit = timeit(fn, hit_sets, (ring, hot, host), FLAGS.iters)
            decode_ms = {}
            for name, (sets, hot_d, want_d) in decode_sets.items():
                equal = equal and identical(fn(*sets[0], ring, hot_d, host), want_d, sets[0][0])
                decode_ms[name] = timeit(fn, sets, (ring, hot_d, host), FLAGS.iters) * 1e3
            sweep.append({"block_rows": block_rows, "num_warps": num_warps, "bit_identical_to_reference": equal,
                          "all_misses_ms": t_miss * 1e3, "all_hits_ms": t_hit * 1e3,
                          "all_misses_host_GBps": M * fmt.bytes_per_row / t_miss / 1e9, "decode_ms": decode_ms})
            print(f"sweep block_rows={block_rows:>2} num_warps={num_warps}: misses {t_miss * 1e3:.4f} ms, "
                  f"hits {t_hit * 1e3:.4f} ms, decode cases {decode_ms}, identical {equal}")
        results["sweep"] = sweep
        results["sweep_default"] = {"block_rows": hg.DEFAULT_BLOCK_ROWS,
                                    "num_warps": hg.DEFAULT_NUM_WARPS}
    results.update(provenance())
    width = max(32, *(len(name) + 1 for name in results["cases"]))
    print(f"{'case':<{width}}{'ms':>10}{'host GB/s':>12}  bit-identical")
    for name, c in results["cases"].items():  # host GB/s: only the cases that read host memory
        host = f"{c['host_GBps']:>12.2f}" if "host_GBps" in c else f"{'-':>12}"
        print(f"{name:<{width}}{c['ms']:>10.4f}{host}  {c.get('bit_identical_to_reference', '-')}")
    print(f"zero-copy host reads ({big} rows): {zero_copy:.2f} GB/s; bulk copy {results['bulk_copy_GBps']:.2f} GB/s;"
          f" all-miss gather at {100 * results['all_misses_fraction_of_zero_copy']:.1f}% of zero-copy")
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            json.dump(results, f, indent=2)
        print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
    cli.run(main)
