import os

# Tests run on the CPU; 16 host devices exist for the sharding tests (set before jax is imported).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=16")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
