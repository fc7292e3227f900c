import os
import sys
import tempfile

import pytest

# Where PYTHONDONTWRITEBYTECODE is set (this project's machines set it), Python caches no compiled modules, and every
# process of the run compiled its sources again: each pytest worker rewrote the assertions of every test module and of
# hypothesis (pytest rewrites an entry-point plugin's whole package), 3.5 of the 11-12 s a process took to collect
# the suite, and each fresh interpreter the tests start (notebook kernels, the multi-process tests' processes)
# compiled glm53 again. The run caches them as Python does by default, in __pycache__ folders (git ignores them); the
# workers and the processes tests start inherit this.
if os.environ.pop("PYTHONDONTWRITEBYTECODE", None) is not None:
    sys.dont_write_bytecode = False

# Tests run on the CPU; 16 host devices exist for the sharding tests (set before jax is imported). The tests' models are
# tiny, so compiling them costs far more than running them: LLVM's cheaper optimisation level halves the suite's
# time (10.2 -> 6.4 minutes on 2 cores from an empty compile cache), and XLA's older CPU fusion code generation
# (instead of its MLIR fusion emitters) takes a fifth off each compile of the engine's steps (12.1 -> 9.4 s for a
# tiny offload engine's prefill, decode and MTP steps). Every comparison in the tests runs both sides under the same
# flags, and XLA's CPU fast-math stays off.
def _xla_knows(flag: str) -> bool:
    """Whether this jaxlib's XLA accepts ``flag`` (it aborts on a flag it does not know, and the fusion-emitter switch
    is newer than the oldest jax setup.cfg allows): asked of a throwaway process by the run's first process, whose
    workers and the processes tests start inherit the result in XLA_FLAGS. A yes is kept in the temp directory per
    interpreter and jaxlib version: the question took 1.5 s of every run's start, before any worker started. A no is
    asked again next run, so that one failed probe (a machine out of memory) does not drop the flags for good."""
    import importlib.metadata
    import json
    import subprocess
    known_path = os.path.join(tempfile.gettempdir(), f"glm53-test-xla-flags-{os.getuid()}.json")
    key = f"{sys.executable} jaxlib {importlib.metadata.version('jaxlib')}: {flag}"
    try:
        with open(known_path) as f:
            known = json.load(f)
    except (OSError, ValueError):
        known = {}
    if known.get(key) is True:
        return True
    probe = subprocess.run([sys.executable, "-c", "import jax.numpy as jnp; jnp.zeros(1).block_until_ready()"],
                           env={**os.environ, "XLA_FLAGS": flag, "JAX_PLATFORMS": "cpu"}, capture_output=True,
                           timeout=300)
    if probe.returncode != 0:
        return False
    partial = f"{known_path}.{os.getpid()}"
    with open(partial, "w") as f:
        json.dump({**known, key: True}, f)
    os.replace(partial, known_path)  # whole or not at all, whichever run writes last
    return True


if "XLA_FLAGS" not in os.environ:
    _flags = ("--xla_force_host_platform_device_count=16 --xla_backend_optimization_level=0 "
              "--xla_llvm_disable_expensive_passes=true")
    # XLA splits each program's LLVM module into 32 parts compiled on threads; two workers already keep both cores
    # busy, and one part compiled a tiny engine's decode step in 0.89 s against 1.04 s.
    _newer = ("--xla_cpu_use_fusion_emitters=false", "--xla_cpu_parallel_codegen_split_count=1")
    if _xla_knows(" ".join(_newer)):
        _flags += " " + " ".join(_newer)
    else:
        _flags += "".join(" " + f for f in _newer if _xla_knows(f))
    # On a GPU, XLA picks each GEMM's algorithm by timing candidates while compiling. The two cache modes compile
    # separate programs, so on a busy GPU (xdist workers sharing one H200) the timings can pick different algorithms
    # for the same product, and offload's logits then differed from resident's in the last bits (3 of 24 engine
    # tests at 74bc709 with -n 4; all pass run alone, and with -n 4 when autotuning is off). The tests check this
    # code's bit identity, so they take XLA's heuristic choice, a function of the shapes alone.
    _flags += " --xla_gpu_autotune_level=0"
    os.environ["XLA_FLAGS"] = _flags
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Workers sharing one GPU (pytest -n 4 on the H200) each claim 75% of its memory at their first array: 31 of 39
# decode / offload / engine tests failed with runtime errors (2ccf5c9); allocating on demand all 39 passed. No effect
# on the CPU.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# Compiled executables persist in a cache shared by the test processes (xdist workers, subprocess tests): tests of
# the same tiny configs then compile each step once per run instead of once per process. Keys include the whole
# computation, so a stale entry can never be used for different code.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"glm53-test-jax-cache-{os.getuid()}"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

# The float32 tests compare against float32 references at 1e-5: they assume float32 matmuls. On a GPU XLA's default
# precision rounds f32 dot inputs to tf32 (test_api's cached-decode checks missed by ~6e-3 on the H200), so pin it.
# On the CPU this is what XLA does anyway; bf16 models compute the same products either way.
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")


def pytest_runtest_setup(item):
    """``@pytest.mark.devices(n)``: the test builds a mesh of ``n`` devices. On an accelerator host with fewer (one
    H200) it is skipped, saying so; on the CPU it always runs, since the 16 host devices above exist there unless
    XLA_FLAGS was set without them, and then the test fails naming the flag instead of skipping silently in CI."""
    marker = item.get_closest_marker("devices")
    if marker is None:
        return
    import jax
    if jax.default_backend() != "cpu" and jax.device_count() < marker.args[0]:
        pytest.skip(f"needs {marker.args[0]} devices, {jax.device_count()} {jax.default_backend()} device(s) visible")


@pytest.fixture(autouse=True)
def _sigint_handler_restored():
    """No engine call leaves its own SIGINT handler behind: it installs one for the call's length
    (``glm53.engine._one_call_at_a_time``), and one left installed would swallow every later Ctrl-C (a later
    test's, or the user's). Handlers other code leaves are put back silently: nbclient's event loop restores
    Python's default where the worker started with SIGINT ignored (a background run's)."""
    import signal

    before = signal.getsignal(signal.SIGINT)
    yield
    after = signal.getsignal(signal.SIGINT)
    if after is not before:
        signal.signal(signal.SIGINT, before)
        if getattr(after, "__module__", "").startswith("glm53"):
            pytest.fail(f"an engine call left its SIGINT handler {after!r} installed (it found {before!r})")


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """An xdist worker ends as soon as the controller has its results, the last thing it waits for. Its tail after
    the last test took 5-9 s of every run's end: JAX's exit handler freeing every compiled program and the client
    (1.8-4.9 s in a whole run's worker), five garbage collections of pytest's, then the interpreter freeing its
    millions of objects. The worker's ``workerfinished`` message is written before unconfigure, and the controller
    then takes the closed connection for a normal end. The other exit handlers still run (the test python server's
    stop among them: its forked children must not outlive the run); a worker's exit status is not read."""
    if not hasattr(config, "workerinput"):
        return
    import atexit

    jax_api = sys.modules.get("jax._src.api")
    if jax_api is not None and hasattr(jax_api, "clean_up"):
        atexit.unregister(jax_api.clean_up)
    atexit._run_exitfuncs()  # noqa: SLF001
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
