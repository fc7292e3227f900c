"""What a copyback costs a pipelined decode loop, by how the host history is passed to the steps.

Decode dispatches steps ahead of the device; every ``copyback_every`` rows the ring is written to the
``pinned_host`` history in place, which means donating the history. The offload A/B measured the copyback steps'
calls at 12-22 ms of host time instead of ~3.7 ms (about the steps queued ahead), i.e. the device queue drained.
This benchmark isolates that on a stand-in step (a matmul chain of about a decode step's length plus the real hot
gather reading misses from the host history) and compares how the history can travel:

* ``readonly``: steps take the history as a plain input; a separate jitted copyback donates it (glm53 before).
* ``threaded``: every step donates the history and returns it (aliased, nothing copied); copyback separate.
* ``fused``: like ``threaded``, and the copyback is a static variant of the step itself (no extra dispatch).

For each: wall time of ``--steps`` steps with a copyback every ``--every`` steps against the same steps without,
so ``per_copyback_ms`` is what one copyback adds to the loop. Each run checks that the pages written read back
from host memory bit for bit, and that the history stayed in ``pinned_host`` memory.

    python -m experiments.bench_copyback --out=experiments/results/bench_copyback.json
    python -m experiments.bench_copyback --tiny   # CPU smoke run
"""

import importlib
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from kernels_pallas import kv_formats
from glm53.provenance import provenance

hg = importlib.import_module("kernels_pallas.hot_gather")

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "", "write the results JSON here")
flags.DEFINE_bool("tiny", False, "small sizes for a CPU smoke run")
flags.DEFINE_integer("steps", 64, "steps per timed loop")
flags.DEFINE_integer("every", 16, "steps between copybacks")
flags.DEFINE_integer("matmuls", 12, "matmuls per stand-in step (sets its device time)")
flags.DEFINE_integer("repeats", 3, "timed loops per variant and case (median reported)")

VARIANTS = ("readonly", "threaded", "fused")


def main(_):
    on_gpu = jax.default_backend() == "gpu"
    fmt = kv_formats.get_format("q8g64")
    n_hist, page, M, D = ((1 << 18), 64, 2048, 4096) if not FLAGS.tiny else (4096, 16, 64, 64)
    dev = jax.devices()[0]
    host_sh = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    dev_sh = jax.sharding.SingleDeviceSharding(dev)
    rng = np.random.default_rng(0)

    def planes(n):
        lat = jnp.asarray(rng.normal(size=(n, 512)).astype(np.float32))
        rope = jnp.asarray(rng.normal(size=(n, 64)).astype(np.float32))
        return {k: np.asarray(v) for k, v in kv_formats.pack(fmt, lat, rope).items()}

    hist_np = planes(n_hist)
    ring = {k: jnp.asarray(v) for k, v in planes(page).items()}  # the page each copyback writes
    hot = {k: jnp.asarray(v) for k, v in planes(256).items()}
    miss_rows = jnp.asarray(np.sort(rng.choice(n_hist, M, replace=False)).astype(np.int32))
    source = jnp.full((M,), hg.HOST, jnp.int32)
    w = jnp.asarray(rng.normal(size=(D, D)) / np.sqrt(D), jnp.bfloat16)

    def work(x, history):
        if on_gpu:
            latent, _, _ = hg.hot_gather(source, miss_rows, ring, hot, history, kv_format=fmt.name)
        else:  # XLA on CPU cannot gather from pinned_host operands
            h = {n: jax.device_put(v, jax.memory.Space.Device) for n, v in history.items()}
            latent, _, _ = hg.hot_gather_reference(source, miss_rows, ring, hot, h, kv_format=fmt.name)
        for _ in range(FLAGS.matmuls):
            x = jnp.tanh(x @ w)
        return x + latent[: x.shape[0], :1].astype(x.dtype)

    def write(history, at):
        return {n: jax.lax.dynamic_update_slice(v, jax.device_put(ring[n], jax.memory.Space.Host), (at, 0))
                for n, v in history.items()}

    hist_out = {n: host_sh for n in hist_np}
    step_ro = jax.jit(work, donate_argnums=(0,))
    step_th = jax.jit(lambda x, h: (work(x, h), h), donate_argnums=(0, 1), out_shardings=(dev_sh, hist_out))
    step_fu = jax.jit(lambda x, h, at, copyback: (work(x, h), write(h, at) if copyback else h),
                      donate_argnums=(0, 1), static_argnames=("copyback",), out_shardings=(dev_sh, hist_out))
    copyback = jax.jit(write, donate_argnums=(0,), out_shardings=hist_out)

    def run(variant, n_copybacks_wanted):
        history = {n: jax.device_put(v, host_sh) for n, v in hist_np.items()}
        x = jnp.asarray(rng.normal(size=(M, D)), jnp.bfloat16)
        jax.block_until_ready((history, x))
        calls, written = [], []
        t0 = time.perf_counter()
        for i in range(FLAGS.steps):
            due = n_copybacks_wanted and (i + 1) % FLAGS.every == 0
            at = jnp.int32(len(written) * page) if due else None
            t = time.perf_counter()
            if variant == "readonly":
                x = step_ro(x, history)
                if due:
                    history = copyback(history, at)
            elif variant == "threaded":
                x, history = step_th(x, history)
                if due:
                    history = copyback(history, at)
            else:
                x, history = step_fu(x, history, at if due else jnp.int32(0), copyback=bool(due))
            calls.append((time.perf_counter() - t, bool(due)))
            if due:
                written.append(len(written) * page)
        jax.block_until_ready((x, history))
        wall = time.perf_counter() - t0
        kinds = {v.sharding.memory_kind for v in history.values()}
        ok = kinds == {"pinned_host"} and all(
            np.array_equal(np.asarray(history[n])[at: at + page], np.asarray(ring[n]))
            for at in written for n in history)
        return wall, calls, ok, sorted(kinds)

    results = {"backend": jax.default_backend(), "device": dev.device_kind, "jax": jax.__version__,
               "history_rows": n_hist, "page_rows": page, "miss_rows_per_step": M, "steps": FLAGS.steps,
               "every": FLAGS.every, "matmuls": FLAGS.matmuls, "variants": {}}
    for variant in VARIANTS:
        for with_cb in (0, 1):
            run(variant, with_cb)  # compile and warm
        walls, cb_calls, other_calls, ok_all, kinds = {0: [], 1: []}, [], [], True, set()
        for _ in range(FLAGS.repeats):
            for with_cb in (0, 1):
                wall, calls, ok, k = run(variant, with_cb)
                walls[with_cb].append(wall)
                ok_all &= ok
                kinds |= set(k)
                if with_cb:
                    cb_calls += [c for c, due in calls if due]
                    other_calls += [c for c, due in calls[1:] if not due]
        n_cb = FLAGS.steps // FLAGS.every
        without, with_ = float(np.median(walls[0])), float(np.median(walls[1]))
        r = {"wall_without_ms": without * 1e3, "wall_with_ms": with_ * 1e3,
             "per_copyback_ms": (with_ - without) / n_cb * 1e3, "step_ms": without / FLAGS.steps * 1e3,
             "copyback_call_ms_median": float(np.median(cb_calls)) * 1e3,
             "other_call_ms_median": float(np.median(other_calls)) * 1e3,
             "pages_read_back_identical_and_pinned_host": bool(ok_all), "history_memory_kinds": sorted(kinds)}
        results["variants"][variant] = r
        print(f"{variant:>9}: step {r['step_ms']:.3f} ms; {n_cb} copybacks add {r['per_copyback_ms']:.3f} ms each "
              f"(loop {without * 1e3:.1f} -> {with_ * 1e3:.1f} ms); copyback-step call "
              f"{r['copyback_call_ms_median']:.3f} ms vs {r['other_call_ms_median']:.3f} ms; ok {ok_all}")
    results.update(provenance())
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    app.run(main)
