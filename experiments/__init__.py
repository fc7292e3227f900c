"""Experiment entry points (absl + ml_collections), thin wrappers over the library."""

import logging

# JAX logs at INFO that it found no TPU ("Unable to initialize backend 'tpu' ... libtpu.so") on every machine without
# one, and absl prints INFO by default: noise in every run's output.
logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
