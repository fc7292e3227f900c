"""Seconds to trace GLM-5's decode step (configs/glm5.py: 78 layers, 1,730 weights) from abstract weights: nothing is
allocated but a small cache, nothing compiled. What ``glm53.model._weight`` saves: Flax's ``param`` traced every
weight's initialiser (``jax.eval_shape``) at each apply to check the stored weight's shape.

    JAX_PLATFORMS=cpu PYTHONPATH=. python experiments/results/probes/trace_glm5_step.py

On the 2-core CPU machine (2026-12-06, alternating runs): 4.12, 4.56 and 3.72 s with Flax's check (at 324d3cf),
2.88, 2.53 and 3.06 s without it.
"""

import time

import jax
import jax.numpy as jnp

import glm53
from configs import glm5
from glm53.params import param_shapes
from glm53.steps import _abstract

cfg = glm53.ModelConfig.from_config_dict(glm5.get_config().model)
cc = glm53.CacheConfig(mode="resident", kv_format="q8g64", max_len=2048, prefill_chunk=64, hot_rows=2048)
one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
weights = jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=one),
                                 param_shapes(cfg, "bfloat16"))
model = glm53.Model(cfg, weights, dtype="bfloat16", cache_config=cc)
engine = glm53.Engine(model, cc, max_sessions=1)
lanes, lanes_in_bucket = engine._lanes([0])
i32 = jnp.zeros((lanes_in_bucket,), jnp.int32)
args = (model.params, engine.cache, lanes, i32, jnp.ones((lanes_in_bucket,), jnp.int32), jnp.int32(0),
        jnp.float32(0), jnp.float32(1), engine._stop_ids(None), None)
t = time.perf_counter()
model.steps._jit("decode", engine.cache).trace(*_abstract(args), greedy=True, kernels=engine.kernels, copy_pages=0)
print(f"traced GLM-5's decode step in {time.perf_counter() - t:.2f} s")
