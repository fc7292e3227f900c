"""What a copyback costs a pipelined decode loop, by where it runs.

Decode dispatches steps ahead of the device; every ``every`` steps a page of ring rows must reach the
``pinned_host`` history, which means writing into the history in place (donating it). A stand-in step (a matmul
chain of about a decode step's length plus the real hot gather reading misses from the host history) runs three
ways:

* ``separate``: steps take the history as a plain input; a jitted copyback call between steps donates it
  (glm53 before the sessions engine). Its call waits on the host for the queued steps that read the history.
* ``in_step_first``: the step itself writes the due page with ``kernels_pallas.copy_blocks`` (zero-copy writes,
  aliased, the history donated and returned) *before* its reads (glm53 now: ``OffloadCache.begin_step``); a step
  with nothing due writes nothing (the kernel exits at once).
* ``in_step_after``: the same write placed *after* the step's reads. XLA cannot order an aliased write after readers
  it does not depend on, so it copies the whole history (twice) every step: the reason the copy comes first.

For each: wall time of ``--steps`` steps with a page every ``--every`` steps against the same steps without, the
host call times of copyback steps against the others (p99 / median: stalls), the number of whole-history copies in
the compiled step, and a check that the pages read back from host memory bit for bit.

    python -m experiments.bench_copyback --out=experiments/results/bench_copyback.json
    python -m experiments.bench_copyback --tiny   # CPU smoke run
"""

import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from experiments import cli
from glm53.provenance import write_results
from kernels_pallas import kv_formats, ops
from kernels_pallas.hot_gather import HOST

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "", "write the results JSON here")
flags.DEFINE_bool("tiny", False, "small sizes for a CPU smoke run")
flags.DEFINE_integer("steps", 128, "steps per timed loop", lower_bound=1)
flags.DEFINE_integer("every", 16, "steps between copybacks", lower_bound=1)
flags.DEFINE_integer("matmuls", 12, "matmuls per stand-in step (sets its device time)", lower_bound=1)
flags.DEFINE_integer("repeats", 3, "timed loops per variant and case (median reported)", lower_bound=1)

VARIANTS = ("separate", "in_step_first", "in_step_after")


def main(_):
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
    miss_rows = jnp.asarray(np.sort(rng.choice(n_hist // 2, M, replace=False)).astype(np.int32))
    source = jnp.full((M,), HOST, jnp.int32)
    w = jnp.asarray(rng.normal(size=(D, D)) / np.sqrt(D), jnp.bfloat16)

    def work(x, history):
        latent, _, _ = ops.hot_gather(source, miss_rows, ring, hot, history, kv_format=fmt.name,
                                      out_dtype=jnp.bfloat16, impl="auto")
        for _ in range(FLAGS.matmuls):
            x = jnp.tanh(x @ w)
        return x + latent[: x.shape[0], :1].astype(x.dtype)

    def write(history, at):
        # one block of `page` rows at row `at` (count 0 = nothing due)
        count = jnp.where(at >= 0, page, 0).astype(jnp.int32)[None]
        return ops.copy_blocks(history, ring, jnp.zeros((1,), jnp.int32), jnp.maximum(at, 0)[None].astype(jnp.int32),
                               count, block_size=page, impl="auto")

    hist_out = {n: host_sh for n in hist_np}
    step_ro = jax.jit(work, donate_argnums=(0,))
    copyback = jax.jit(write, donate_argnums=(0,), out_shardings=hist_out)
    def first(x, h, at):
        h = write(h, at)
        return work(x, h), h

    def after(x, h, at):
        y = work(x, h)
        return y, write(h, at)

    jits = {"in_step_first": jax.jit(first, donate_argnums=(0, 1), out_shardings=(dev_sh, hist_out)),
            "in_step_after": jax.jit(after, donate_argnums=(0, 1), out_shardings=(dev_sh, hist_out))}

    def history_copies(fn) -> int:
        """Copies of the whole history in the compiled step."""
        h = {n: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=host_sh) for n, v in hist_np.items()}
        x = jax.ShapeDtypeStruct((M, D), jnp.bfloat16, sharding=dev_sh)
        text = fn.lower(x, h, jax.ShapeDtypeStruct((), jnp.int32, sharding=dev_sh)).compile().as_text()
        shapes = {f"[{v.shape[0]},{v.shape[1]}]" for v in hist_np.values()}
        return sum(1 for line in text.splitlines() if re.search(r"\bcopy(-start)?\(", line)
                   and any(s in line.split("=")[1] for s in shapes))

    def run(variant, with_cb):
        history = {n: jax.device_put(v, host_sh) for n, v in hist_np.items()}
        x = jnp.asarray(rng.normal(size=(M, D)), jnp.bfloat16)
        jax.block_until_ready((history, x))
        calls, written = [], []
        t0 = time.perf_counter()
        for i in range(FLAGS.steps):
            due = with_cb and (i + 1) % FLAGS.every == 0
            at = len(written) * page + n_hist // 2 if due else -1
            t = time.perf_counter()
            if variant == "separate":
                x = step_ro(x, history)
                if due:
                    history = copyback(history, jnp.int32(at))
            else:
                x, history = jits[variant](x, history, jnp.int32(at))
            calls.append((time.perf_counter() - t, bool(due)))
            if due:
                written.append(at)
        jax.block_until_ready((x, history))
        wall = time.perf_counter() - t0
        kinds = {v.sharding.memory_kind for v in history.values()}
        ok = kinds == {"pinned_host"} and all(
            np.array_equal(np.asarray(history[n])[at: at + page], np.asarray(ring[n])) for at in written
            for n in history)
        return wall, calls, ok

    results = {"backend": jax.default_backend(), "device": dev.device_kind, "jax": jax.__version__,
               "history_rows": n_hist, "page_rows": page, "miss_rows_per_step": M, "steps": FLAGS.steps,
               "every": FLAGS.every, "matmuls": FLAGS.matmuls, "variants": {}}
    for variant in VARIANTS:
        for with_cb in (False, True):
            run(variant, with_cb)  # compile and warm
        walls, cb_calls, other_calls, all_calls, ok_all = {False: [], True: []}, [], [], [], True
        for _ in range(FLAGS.repeats):
            for with_cb in (False, True):
                wall, calls, ok = run(variant, with_cb)
                walls[with_cb].append(wall)
                ok_all &= ok
                if with_cb:
                    cb_calls += [c for c, due in calls if due]
                    other_calls += [c for c, due in calls[1:] if not due]
                    all_calls += [c for c, _ in calls[1:]]
        n_cb = FLAGS.steps // FLAGS.every
        without, with_ = float(np.median(walls[False])), float(np.median(walls[True]))
        p50, p99 = np.percentile(all_calls, [50, 99])
        r = {"wall_without_ms": without * 1e3, "wall_with_ms": with_ * 1e3,
             "per_copyback_ms": (with_ - without) / n_cb * 1e3, "step_ms": without / FLAGS.steps * 1e3,
             "copyback_call_ms_median": float(np.median(cb_calls)) * 1e3,
             "other_call_ms_median": float(np.median(other_calls)) * 1e3,
             "call_p99_over_median": float(p99 / p50),
             "history_copies_in_step": history_copies(jits[variant]) if variant in jits else 0,
             "pages_read_back_identical_and_pinned_host": bool(ok_all)}
        results["variants"][variant] = r
        print(f"{variant:>14}: step {r['step_ms']:.3f} ms; {n_cb} copybacks add {r['per_copyback_ms']:.3f} ms each "
              f"(loop {without * 1e3:.1f} -> {with_ * 1e3:.1f} ms); copyback-step call "
              f"{r['copyback_call_ms_median']:.3f} ms vs {r['other_call_ms_median']:.3f} ms, p99/p50 "
              f"{r['call_p99_over_median']:.2f}; whole-history copies in the step {r['history_copies_in_step']}; "
              f"ok {ok_all}", flush=True)
    write_results(FLAGS.out, results)


if __name__ == "__main__":
    cli.run(main)
