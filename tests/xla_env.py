"""The XLA flags a test gives the processes it starts: this run's own (the cheaper LLVM optimisation conftest.py
sets: without it a subprocess compiles the tiny models' steps at full optimisation, about twice as long) with the
host device count left to the caller."""

import os


def xla_flags(devices: int | None = None) -> str:
    """This process's ``XLA_FLAGS`` without its device count, plus ``devices`` host devices if given."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
    if devices:
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    return " ".join(flags)
