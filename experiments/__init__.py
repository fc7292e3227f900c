"""Experiment entry points (absl + ml_collections), thin wrappers over the library."""

import logging
import os
import sys

# JAX logs at INFO that it found no TPU ("Unable to initialize backend 'tpu' ... libtpu.so") on every machine without
# one, and absl prints INFO by default: noise in every run's output.
logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)


class _QuietOrbaxInfo(logging.Filter):
    """Orbax logs each checkpoint read and write at INFO through absl's logger (a handful of lines per load or
    session save): kept from the entry points' output; its warnings and errors still show."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            return True
        # The record names absl's own frame as its origin (absl resolves the caller later, in its formatter): the
        # first frame outside the logging machinery is the caller.
        frame = sys._getframe(1)
        while frame is not None:
            path = frame.f_code.co_filename
            if "orbax" in path:
                return False
            if os.sep + "logging" + os.sep not in path and os.sep + "absl" + os.sep not in path:
                return True
            frame = frame.f_back
        return True


logging.getLogger("absl").addFilter(_QuietOrbaxInfo())
