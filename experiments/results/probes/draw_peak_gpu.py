"""Device memory of drawing h200_bench's embedding (154,880 x 6,144 bfloat16, 1.77 GiB) block by block
(glm53.params.normal_leaf) and whole (one random.normal, as before 8e59a07): peak_bytes_in_use over the leaf."""
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from glm53 import params as P

dev = jax.local_devices()[0]
shape, out = (154880, 6144), {}
for mode in ("blocks", "whole"):  # the lower first: the allocator's peak only grows
    P.DRAW_BLOCK_ELEMENTS = (1 << 24) if mode == "blocks" else (1 << 40)
    before = dev.memory_stats()["bytes_in_use"]
    x = P.normal_leaf(jax.random.key(0), 1, np.float32(0.02), shape, jnp.bfloat16).block_until_ready()
    s = dev.memory_stats()
    out[mode] = {"leaf_bytes": x.nbytes, "peak_over_start_bytes": s["peak_bytes_in_use"] - before,
                 "transient_bytes_per_element_of_a_block": (s["peak_bytes_in_use"] - before - x.nbytes) / (
                     (1 << 24) if mode == "blocks" else x.size)}
    del x
print(json.dumps({"device": str(dev.device_kind), "shape": shape, **out}, indent=1))
if len(sys.argv) > 1:
    json.dump({"device": str(dev.device_kind), "shape": shape, **out}, open(sys.argv[1], "w"), indent=1)
