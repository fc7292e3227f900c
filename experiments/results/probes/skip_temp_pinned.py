"""Probe: can a process on XLA's VMM allocator (``--xla_gpu_command_buffer_update_mode=SKIP_TEMP``, which gives the
temporaries a command buffer reads stable virtual addresses) hold the offload engine's ``pinned_host`` pool?

Since the engine's output rings keep every argument and output where it was (``glm53.engine._StepRing``), the
temporaries are what still makes XLA record a step's CUDA graphs again: at each run's first calls
(``cmdbuf_updates_indexer_3bb4d37.json``), and at every call when anything is allocated between two steps.
SKIP_TEMP would keep them put, but at 902d246 the offload engine segfaulted allocating its pool under it
(``sessions_ab_skip_temp_segfault_902d246.log``: ``glm53.offload.allocate_pool``, a jitted zeros placed in
``pinned_host``): in XLA's allocator setup the VMM branch returns before the host memory space gets its allocator.
This tries other ways to make a pinned_host array, each in a subprocess of its own (a segfault ends only it):

- ``jit_zeros``: the engine's way (a jitted zeros with ``pinned_host`` out_shardings);
- ``device_put_numpy``: ``jax.device_put`` of a host numpy array to a ``pinned_host`` sharding;
- ``device_put_device``: a device array moved to ``pinned_host`` with ``jax.device_put``;

and for each that makes one, reads it in a jitted step (host -> device) and moves a device array to pinned_host;
then (``engine_tiny``) the offload engine itself on the tiny config against a resident one, 16 tokens.

    XLA_FLAGS=--xla_gpu_command_buffer_update_mode=SKIP_TEMP python skip_temp_pinned.py [OUT.json]
"""
import json
import os
import subprocess
import sys

METHODS = ("device_put_numpy", "device_put_device", "jit_zeros", "engine_tiny")


def child(method: str) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    dev = jax.local_devices()[0]
    host = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    on_dev = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
    shape = (1 << 16, 512)  # 32 MiB of int8, a small pool plane
    if method == "jit_zeros":
        x = jax.jit(lambda: jnp.zeros(shape, jnp.int8), out_shardings=host)()
    elif method == "device_put_numpy":
        x = jax.device_put(np.zeros(shape, np.int8), host)
    else:
        x = jax.device_put(jnp.zeros(shape, jnp.int8, device=dev), host)
    x.block_until_ready()
    print(f"made {x.sharding.memory_kind} {x.shape}", flush=True)

    @jax.jit
    def read(pool, rows):
        return jnp.take(jax.device_put(pool, on_dev), rows, axis=0).astype(jnp.int32).sum()

    total = read(x, jnp.arange(8))
    back = jax.device_put(jnp.full(shape, 7, jnp.int8, device=dev), host)  # device -> pinned_host
    print(json.dumps({"method": method, "ok": True, "read_sum": int(total), "written": int(np.asarray(back)[3, 0]),
                      "memory_kind": back.sharding.memory_kind}), flush=True)


def engine_child() -> None:
    """The offload engine itself (the tiny config): a prefill, 16 greedy tokens, and a resident engine's tokens."""
    import glm53
    from configs import tiny

    c = tiny.get_config()
    model = glm53.from_config(c.model, seed=0)
    out = {}
    for mode in ("offload", "resident"):
        e = glm53.Engine(model, cache=glm53.CacheConfig.from_config_dict(c.cache).replace(mode=mode), max_sessions=2)
        sid = e.open(list(range(1, 200)))
        out[mode] = e.generate({sid: 16})[sid]
    print(json.dumps({"method": "engine_tiny", "ok": True, "tokens_equal": out["offload"] == out["resident"],
                      "output_ring": e.output_ring}), flush=True)


def main() -> None:
    results = []
    for m in METHODS:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
        p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", m], capture_output=True, text=True,
                           timeout=300, env=env, cwd=root)
        line = next((ln for ln in p.stdout.splitlines() if ln.startswith("{")), None)
        res = json.loads(line) if line else {"method": m, "ok": False}
        res.update(rc=p.returncode, stderr_tail=p.stderr[-600:], xla_flags=os.environ.get("XLA_FLAGS", ""))
        print(json.dumps({k: v for k, v in res.items() if k != "stderr_tail"}), flush=True)
        results.append(res)
    if len(sys.argv) > 1:
        json.dump(results, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        engine_child() if sys.argv[2] == "engine_tiny" else child(sys.argv[2])
    else:
        main()
