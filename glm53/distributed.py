"""Several processes, one program: JAX's multi-controller runtime (``jax.distributed``), one process per host.

Every process runs the same script on the same inputs; a mesh spans the devices of all of them
(``glm53.sharding.make_mesh``), parameters and caches are global arrays, and each jitted step runs on every process
at once, XLA's collectives (NCCL on GPUs, gloo on CPUs) joining them. The engine's host-side bookkeeping is
deterministic, so every process keeps the same session table without talking to the others.

    # each process, before anything else touches JAX (experiments.launch does this on one machine):
    GLM53_COORDINATOR=host0:12355 GLM53_NUM_PROCESSES=2 GLM53_PROCESS_ID=0 python -m experiments.generate ...

``initialize()`` reads those variables (or takes the values as arguments); without them it does nothing, and one
process is the default. Only process 0 writes results (``is_writer()``) and session saves (``Engine.save``: the
others wait for it and learn whether it succeeded; every process reads a save to restore it).
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import NoReturn

import jax

from glm53.config import ConfigError

ENV = ("GLM53_COORDINATOR", "GLM53_NUM_PROCESSES", "GLM53_PROCESS_ID")
# Seconds a process waits for all the others to join (JAX's own default); ``GLM53_JOIN_TIMEOUT_S`` overrides it.
JOIN_TIMEOUT_S = 300


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, join_timeout_s: int | None = None) -> bool:
    """Join the processes of a run (``jax.distributed.initialize``), from the arguments or ``GLM53_COORDINATOR`` /
    ``GLM53_NUM_PROCESSES`` / ``GLM53_PROCESS_ID``. Returns whether it did (False: one process, nothing to join).
    Must run before JAX creates its backends; on CPUs it selects the gloo collectives.

    It says on stderr what it waits for: a process of a run whose other processes never start (a wrong
    ``GLM53_NUM_PROCESSES``, a host not launched) waits ``join_timeout_s`` (``GLM53_JOIN_TIMEOUT_S``, default 300)
    and is then aborted by XLA with a message about "another task" having died."""
    coordinator = coordinator or os.environ.get(ENV[0])
    if num_processes is None and os.environ.get(ENV[1]):
        num_processes = int(os.environ[ENV[1]])
    if process_id is None and os.environ.get(ENV[2]):
        process_id = int(os.environ[ENV[2]])
    given = [coordinator is not None, num_processes is not None, process_id is not None]
    if not any(given):
        return False
    if not all(given):
        raise ConfigError(f"a multi-process run needs all of {', '.join(ENV)} (or the three arguments); got "
                          f"coordinator={coordinator!r}, num_processes={num_processes!r}, process_id={process_id!r}")
    if num_processes < 1 or not 0 <= process_id < num_processes:
        raise ConfigError(f"process_id={process_id} must be in [0, num_processes={num_processes})")
    if num_processes == 1:
        return False
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms in ("", "cpu") or platforms.startswith("cpu"):
        # CPU devices of several processes talk through gloo (the default CPU backend has no cross-process
        # collectives); harmless where an accelerator backend is used.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if join_timeout_s is None:
        join_timeout_s = int(os.environ.get("GLM53_JOIN_TIMEOUT_S") or JOIN_TIMEOUT_S)
    print(f"glm53.distributed: process {process_id} of {num_processes} joining at {coordinator}; waiting up to "
          f"{join_timeout_s} s for all {num_processes} to join (GLM53_JOIN_TIMEOUT_S; if they never do, XLA aborts "
          "this process saying another task died: check GLM53_NUM_PROCESSES and that every process was started)",
          file=sys.stderr, flush=True)
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id,
                               initialization_timeout=join_timeout_s)
    global _joined
    _joined = True
    sys.excepthook = _exit_at_once
    return True


# Whether this process joined others (``initialize``). Such a process that fails must end at once: JAX's exit
# handler would first wait at jax.distributed's shutdown barrier for its peers, which are themselves waiting for it
# in a collective or at start-up, until the coordination service times out (30 s to minutes), and a launcher that
# stops the others when one fails (experiments.launch) would see no exit meanwhile.
_joined = False


def _exit_at_once(kind, value, tb) -> None:
    traceback.print_exception(kind, value, tb)
    fail(f"process {jax.process_index()} of {jax.process_count()} failed ({kind.__name__}): exiting without waiting "
         "for the others")


def fail(message: str, code: int = 1) -> NoReturn:
    """End this process with ``message`` on stderr and exit status ``code``; after ``initialize`` joined other
    processes, at once (``os._exit``: no exit handlers, so no wait at the shutdown barrier)."""
    print(message, file=sys.stderr, flush=True)
    if _joined:
        sys.stdout.flush()
        os._exit(code)
    sys.exit(code)


def is_writer() -> bool:
    """Whether this process writes results (process 0; the only one without ``jax.distributed``)."""
    return jax.process_index() == 0
