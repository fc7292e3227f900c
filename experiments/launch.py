"""Run one entry point as several processes on this machine: the multi-process layout of a multi-host run
(``glm53.distributed``), here on localhost, each process with its own CPU (or GPU) devices.

    python -m experiments.launch --processes=2 --devices_per_process=8 -- \\
        python -m experiments.generate --config=configs/tiny.py --config.model.num_attention_heads=16 \
        --config.mesh.tp=16 --noroofline

Every process gets ``GLM53_COORDINATOR`` (localhost and a free port), ``GLM53_NUM_PROCESSES`` and
``GLM53_PROCESS_ID``, and on CPUs ``XLA_FLAGS=--xla_force_host_platform_device_count=<devices_per_process>``;
the entry point calls ``glm53.distributed.initialize()`` first. Output lines are prefixed with ``[p<i>]``; the
launcher fails (exit status 1) if any process does, stopping the others then (a process that joined them exits at
once when it fails: ``glm53.distributed.fail``), and stops them all after ``--timeout`` seconds.
On several real hosts, start the entry point once per host with the same three variables instead.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import sys
import threading
import time

from absl import app, flags

from experiments import cli

FLAGS = flags.FLAGS
flags.DEFINE_integer("processes", 2, "processes to start", lower_bound=1)
flags.DEFINE_integer("devices_per_process", 8, "CPU devices per process (XLA's host platform device count); "
                     "0 leaves XLA_FLAGS alone (GPU runs: each process sees its own GPUs)", lower_bound=0)
flags.DEFINE_integer("timeout", 1800, "seconds before every process is stopped", lower_bound=1)


def _ephemeral_ports() -> tuple[int, int]:
    """The range the kernel picks outgoing connections' local ports from (Linux: 32768-60999 by default)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 65535  # Linux's range starts here; macOS's and Windows' (49152) above it


def _bindable(port: int) -> bool:
    """Whether nothing holds ``port``, on every IPv4 and (where there is IPv6) every IPv6 address: the coordination
    service binds ``[::]:port``."""
    for family, address in ((socket.AF_INET, ""), (socket.AF_INET6, "::")):
        try:
            s = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue  # no IPv6 here
        with s:
            try:
                s.bind((address, port))
            except OSError:
                return False
    return True


def free_port(rng: random.Random | None = None) -> int:
    """A free port for the coordinator, below the ephemeral range. A port from that range (what binding port 0
    gives) was free when asked for, but until process 0's coordination service bound it, any outgoing connection on
    the machine could take it as its local port: gloo's and gRPC's, of this run's processes or another run's. Then
    the service could not bind it and process 0 crashed (exit -11; once in the test suite, 2026-12-06, with two
    multi-process tests running at once). Below the range only a listener can take it, as a check finds."""
    rng = rng or random.SystemRandom()
    low, _ = _ephemeral_ports()
    if low > 2048:
        for _ in range(200):
            port = rng.randrange(max(1024, low - 16384), low)
            if _bindable(port):
                return port
    with socket.socket() as s:  # nothing free below the range: an ephemeral port, as before
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _pump(stream, prefix: str, sink) -> None:
    for line in iter(stream.readline, ""):
        sink.write(f"{prefix} {line}")
        sink.flush()


def xla_flags_with_devices(xla_flags: str, devices: int | None) -> str:
    """``xla_flags`` (an ``XLA_FLAGS`` value) with its host device count replaced by ``devices`` (removed if None)."""
    flags_ = [f for f in xla_flags.split() if "host_platform_device_count" not in f]
    return " ".join(flags_ + ([f"--xla_force_host_platform_device_count={devices}"] if devices else []))


def launch(command: list[str], processes: int, devices_per_process: int, timeout: float) -> int:
    if not command:
        raise app.UsageError("give the command after --, e.g. -- python -m experiments.generate ...")
    if processes < 1:  # none started would report success for a run that never ran
        raise app.UsageError(f"--processes={processes}: at least one process")
    if shutil.which(command[0]) is None:  # before any process starts: Popen's FileNotFoundError came as a traceback
        raise app.UsageError(f"cannot run {command[0]!r}: no such program (the command after -- runs as it is, e.g. "
                             "-- python -m experiments.generate ...)")
    coordinator = f"localhost:{free_port()}"
    procs, pumps = [], []
    for i in range(processes):
        env = dict(os.environ, GLM53_COORDINATOR=coordinator, GLM53_NUM_PROCESSES=str(processes),
                   GLM53_PROCESS_ID=str(i), PYTHONUNBUFFERED="1")
        if devices_per_process:
            env["XLA_FLAGS"] = xla_flags_with_devices(env.get("XLA_FLAGS", ""), devices_per_process)
        p = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        procs.append(p)
        t = threading.Thread(target=_pump, args=(p.stdout, f"[p{i}]", sys.stdout), daemon=True)
        t.start()
        pumps.append(t)
    deadline = time.monotonic() + timeout
    codes = [None] * processes
    while any(c is None for c in codes):
        for i, p in enumerate(procs):
            codes[i] = p.poll()
        if any(c not in (None, 0) for c in codes) or time.monotonic() > deadline:
            break  # one failed (the others would wait for it forever) or time is up
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            p.kill()
    for t in pumps:
        t.join(timeout=5)
    codes = [p.wait() for p in procs]
    print(f"[launch] exit codes {codes}", flush=True)
    return 0 if all(c == 0 for c in codes) else 1


def main(argv):
    sys.exit(launch(argv[1:], FLAGS.processes, FLAGS.devices_per_process, FLAGS.timeout))


if __name__ == "__main__":
    cli.run(main)
