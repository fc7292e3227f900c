"""The parameter pytree: its shapes (without allocating) and random initialisation, and the dtypes glm53 runs in."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from glm53.cache import Lanes, init_resident
from glm53.config import CacheConfig, ModelConfig
from glm53.model import GLM5, make_step

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "f32": jnp.float32, "bf16": jnp.bfloat16}


def resolve_dtype(dtype) -> Any:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} unknown; choose one of {sorted(DTYPES)}")
        return DTYPES[dtype]
    dt = jnp.dtype(dtype)
    if dt not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"dtype {dt} unsupported; use float32 or bfloat16")
    return dt.type


def _dummy_inputs(cfg: ModelConfig, dtype):
    cache = init_resident(cfg, CacheConfig(kv_format="f32"), 1, 128, dtype)
    lanes = Lanes(slot=jnp.zeros((1,), jnp.int32), active=jnp.ones((1,), bool))
    step = make_step(jnp.zeros((1,), jnp.int32), jnp.ones((1,), jnp.int32), 1, 128, cfg, dtype, lanes,
                     kernels="reference")
    return jnp.zeros((1, 1), jnp.int32), step, cache


def _init_all(module: GLM5, key, tokens, step, cache):
    """Create every parameter (main layers and MTP) by running each method once."""
    cfg = module.cfg

    def run(m, tokens, step, cache):
        hidden, cache, _ = m(tokens, step, cache)
        m.logits(hidden)
        if cfg.num_nextn_predict_layers:
            m.mtp(hidden, tokens, step, cache)

    return module.init(key, tokens, step, cache, method=run)["params"]


def param_shapes(cfg: ModelConfig, dtype) -> Any:
    """The parameter pytree as ShapeDtypeStructs, without allocating anything."""
    module = GLM5(cfg, dtype)
    return jax.eval_shape(lambda: _init_all(module, jax.random.key(0), *_dummy_inputs(cfg, dtype)))


_ONES = ("weight", "k_norm_weight")  # RMSNorm / LayerNorm scales
_ZEROS = ("k_norm_bias", "e_score_correction_bias")


def init_params(cfg: ModelConfig, dtype, seed: int = 0) -> Any:
    """Random parameters: normal(0, initializer_range) matrices, unit norm scales, zero biases (as transformers
    initialises GLM-5). Filled leaf by leaf from the shapes, so the model itself is never compiled for this."""
    from flax.traverse_util import flatten_dict, unflatten_dict

    flat = flatten_dict(param_shapes(cfg, dtype))
    paths = sorted(flat)

    @jax.jit
    def make(key):
        out = {}
        for i, path in enumerate(paths):
            s = flat[path]
            if path[-1] in _ONES:
                out[path] = jnp.ones(s.shape, s.dtype)
            elif path[-1] in _ZEROS:
                out[path] = jnp.zeros(s.shape, s.dtype)
            else:
                k = jax.random.fold_in(key, i)
                out[path] = (cfg.initializer_range * jax.random.normal(k, s.shape, jnp.float32)).astype(s.dtype)
        return out

    return unflatten_dict(make(jax.random.key(seed)))


def num_params(params) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params))


def nbytes(params) -> int:
    return sum(int(x.nbytes) for x in jax.tree_util.tree_leaves(params))
