"""What allocating the offload host pool costs: time, peak host RSS and device memory, by method.

The pool is ``--gib`` GiB of q8g64 planes (int8 latent, bf16 scales and rope) in ``pinned_host`` memory. Methods:

* ``old``: ``jax.device_put(np.zeros(shape), host)`` for every plane at once (glm53's ``init_offload`` before the pool
  was allocated plane by plane);
* ``new``: ``glm53.offload.allocate_pool``: the same transfer of calloc'd zeros one plane at a time, with a progress
  bar and a check of XLA's pinned host allocator limit;
* ``jit_zeros``: a jitted ``jnp.zeros`` with pinned_host ``out_shardings`` per plane (rejected in ``allocate_pool``:
  on GPUs XLA builds the zeros in device memory and copies them out; on the CPU backend the result aborts the process
  once donated to a jitted step).

Each method runs in a fresh process, so its peak RSS is its own (``VmHWM``, reset once the backend is up). On GPUs
``--pinned_limit_gb`` sets ``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`` for the children (XLA's pinned host allocator holds
64 GiB unless told otherwise). ``--verify`` reads the first and last page of every plane back through
``kernels_pallas.ops.copy_blocks`` (the engine's path) and checks they are zero.

    python -m experiments.probe_pool_alloc --gib=80 --out=experiments/results/pool_alloc.json   # GPU machine
    python -m experiments.probe_pool_alloc --gib=2 --methods=old,new                            # CPU smoke run
"""

import json
import math
import os
import subprocess
import sys
import time

from absl import flags

from experiments import cli

FLAGS = flags.FLAGS
flags.DEFINE_float("gib", 4.0, "pool size in GiB")
flags.DEFINE_list("methods", ["old", "new", "jit_zeros"], "allocation methods to measure, each in its own process")
flags.DEFINE_integer("pinned_limit_gb", 0, "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB for the children (0: the pool + 8)")
flags.DEFINE_bool("verify", True, "read the first and last page of each plane back and check they are zero")
flags.DEFINE_string("out", "", "write the results JSON here")
flags.DEFINE_string("child", "", "internal: measure this one method and print its result as JSON")

PAGE_ROWS = 64


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux: write 5 to /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _measure(method: str) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from glm53 import offload
    from kernels_pallas import kv_formats, ops

    fmt = kv_formats.get_format("q8g64")
    rows = max(PAGE_ROWS, int(FLAGS.gib * 2**30) // fmt.bytes_per_row // PAGE_ROWS * PAGE_ROWS)
    device = jax.devices()[0]
    host = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    shapes = fmt.plane_shapes(rows)
    jax.block_until_ready(jnp.zeros((8,)))  # the backend is up before the baseline
    if method == "jit_zeros":  # compile outside the timed part
        makers = {n: jax.jit(lambda s=shape, d=dt: jnp.zeros(s, d), out_shardings=host).lower().compile()
                  for n, (shape, dt) in shapes.items()}
    rss_before = _status_kib("VmRSS")
    peak_reset = _reset_peak_rss()
    t0 = time.perf_counter()
    if method == "old":
        pool = {n: jax.device_put(np.zeros(shape, dt), host) for n, (shape, dt) in shapes.items()}
        jax.block_until_ready(pool)
    elif method == "new":
        pool = offload.allocate_pool(fmt, rows, device)
    elif method == "jit_zeros":
        pool = {n: makers[n]() for n in shapes}
        jax.block_until_ready(pool)
    else:
        raise ValueError(f"unknown method {method!r}")
    seconds = time.perf_counter() - t0
    result = {
        "method": method, "rows": rows, "pool_bytes": sum(int(v.nbytes) for v in pool.values()), "seconds": seconds,
        "rss_before_gib": rss_before / 2**20, "rss_after_gib": _status_kib("VmRSS") / 2**20,
        "peak_rss_gib": _status_kib("VmHWM") / 2**20 if peak_reset else None,
        "memory_kinds": sorted({v.sharding.memory_kind for v in pool.values()}),
    }
    stats = device.memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        result["device_peak_gib"] = stats["peak_bytes_in_use"] / 2**30
    if FLAGS.verify:
        ends = jnp.asarray([0, rows - PAGE_ROWS], jnp.int32)
        buf = {n: jnp.ones((2 * PAGE_ROWS, v.shape[1]), v.dtype) for n, v in pool.items()}
        buf = ops.copy_blocks(buf, pool, ends, jnp.asarray([0, PAGE_ROWS], jnp.int32),
                              jnp.full((2,), PAGE_ROWS, jnp.int32), block_size=PAGE_ROWS, impl="auto")
        result["zero"] = all(not np.asarray(v).any() for v in buf.values())
    return result


def main(_):
    if FLAGS.child:
        print(json.dumps(_measure(FLAGS.child)))
        return
    env = dict(os.environ)
    env.setdefault("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB",
                   str(FLAGS.pinned_limit_gb or math.ceil(FLAGS.gib) + 8))
    results = []
    for method in FLAGS.methods:
        cmd = [sys.executable, "-m", "experiments.probe_pool_alloc", f"--child={method}", f"--gib={FLAGS.gib}",
               f"--verify={FLAGS.verify}"]
        run = subprocess.run(cmd, env=env, capture_output=True, text=True)
        lines = [ln for ln in run.stdout.splitlines() if ln.startswith("{")]
        r = json.loads(lines[-1]) if run.returncode == 0 and lines else {
            "method": method, "returncode": run.returncode, "error": run.stderr[-2000:]}
        results.append(r)
        print(json.dumps(r))
    from glm53.provenance import provenance

    out = {"gib": FLAGS.gib, "pinned_limit_gb": env["XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"], "results": results,
           **provenance()}
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            json.dump(out, f, indent=2)
        print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
    cli.run(main)
