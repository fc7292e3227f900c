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
several processes and send it to the others. It also lets the other processes write the programs that run on their
own devices alone (a pipeline's later stages), which JAX leaves to process 0 and process 0 never compiles: in a warm
run, process 1 of the two-process pipeline test compiled 212 of them again (16 s) every time; now it loads them
(2-process run 42 -> 29 s wall, 58 -> 42 CPU-s). Where this JAX has no ``_hash_accelerator_config`` or
``_cache_write`` to replace, it changes nothing and the run is only slower."""

import warnings

import jax


def share_compilations() -> bool:
    """Call after ``glm53.distributed.initialize()``; returns whether it took effect (a CPU run of several
    processes, on this JAX)."""
    try:
        from jax._src import cache_key, compilation_cache, compiler
    except ImportError:
        return False
    original = getattr(cache_key, "_hash_accelerator_config", None)
    write = getattr(compiler, "_cache_write", None)
    if original is None or write is None or jax.process_count() == 1 or jax.default_backend() != "cpu":
        return False

    def hash_devices(hash_obj, accelerators):
        devices = list(accelerators.flat)
        if devices and all(d.platform == "cpu" for d in devices):
            hash_obj.update(repr([(d.id, d.process_index) for d in devices]).encode())
        else:
            original(hash_obj, accelerators)

    def write_from_this_process_too(key, compile_time_secs, module_name, backend, executable, host_callbacks):
        # In a process other than 0 this is a program of its own devices only: one spanning processes is compiled
        # by process 0 and sent (jax_share_binary_between_hosts, below), or, with host callbacks, never written.
        # So no two processes write one key.
        if (jax.process_index() == 0 or host_callbacks
                or compile_time_secs < jax.config.jax_persistent_cache_min_compile_time_secs):
            return write(key, compile_time_secs, module_name, backend, executable, host_callbacks)
        try:  # as JAX's own write: a failed write costs a later compile, not this run
            compilation_cache.put_executable_and_time(key, module_name, executable, backend, int(compile_time_secs))
        except Exception as e:  # noqa: BLE001
            warnings.warn(f"persistent cache entry for {module_name!r} not written: {type(e).__name__}: {e}")

    cache_key._hash_accelerator_config = hash_devices
    compiler._cache_write = write_from_this_process_too
    jax.config.update("jax_share_binary_between_hosts", True)
    return True
