"""One compilation per program in a multi-process CPU run, for the processes tests/test_distributed.py launches.

JAX writes persistent-cache entries from process 0 only, and keys them by, among other things, a fingerprint of the
devices' topology. On the CPU that fingerprint differs between the processes of one run (jaxlib 0.10.2: the two
processes of ``experiments.launch --processes=2 --devices_per_process=1`` hash the same two devices to different
values; every other part of the key is equal), so process 1 never found process 0's entries: it compiled every
program again in every run, warm cache or not (15 of a warm two-process pipeline run's 40 s), and process 0 waited
for it at the first collective of each. For the same reason ``jax_share_binary_between_hosts`` (process 0 compiles,
the others receive the binary) deadlocked: process 1 waited for a key process 0 never wrote, until gloo's 30 s
timeout. On GPUs JAX means the key to be the same in every process (it strips the device assignment from it there
for that reason; not checked here: no machine of several GPUs was lent), so this concerns the CPU runs of the tests
only and lives here, not in glm53.

``share_compilations()`` keys CPU programs by their devices' ids and processes instead (what the fingerprint stands
for on a CPU: the compile options hold the device assignment too) and has process 0 compile each program that spans
several processes and send it to the others. Where this JAX has no ``_hash_accelerator_config`` to replace, it
changes nothing and the run is only slower."""

import jax


def share_compilations() -> bool:
    """Call after ``glm53.distributed.initialize()``; returns whether it took effect (a CPU run of several
    processes, on this JAX)."""
    try:
        from jax._src import cache_key
    except ImportError:
        return False
    original = getattr(cache_key, "_hash_accelerator_config", None)
    if original is None or jax.process_count() == 1 or jax.default_backend() != "cpu":
        return False

    def hash_devices(hash_obj, accelerators):
        devices = list(accelerators.flat)
        if devices and all(d.platform == "cpu" for d in devices):
            hash_obj.update(repr([(d.id, d.process_index) for d in devices]).encode())
        else:
            original(hash_obj, accelerators)

    cache_key._hash_accelerator_config = hash_devices
    jax.config.update("jax_share_binary_between_hosts", True)
    return True
