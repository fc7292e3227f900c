"""The parameter pytree: its shapes (without allocating) and random initialisation, and the dtypes glm53 runs in."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from glm53.cache import Lanes, init_resident
from glm53.config import CacheConfig, ConfigError, ModelConfig
from glm53.model import GLM5, make_step
from kernels_pallas import grouped_matmul as _gmm

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "f32": jnp.float32, "bf16": jnp.bfloat16}


def resolve_dtype(dtype) -> Any:
    # A ConfigError (a ValueError): the entry points say it in one line, as they do every setting that cannot work.
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ConfigError(f"dtype {dtype!r} unknown; choose one of {sorted(DTYPES)}")
        return DTYPES[dtype]
    try:
        dt = jnp.dtype(dtype) if dtype is not None else None  # NumPy reads None as float64
    except TypeError:
        raise ConfigError(f"dtype {dtype!r} is not a dtype; use float32 or bfloat16") from None
    if dt not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ConfigError(f"dtype {dt} unsupported; use float32 or bfloat16")
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


EXPERT_WEIGHTS = ("model", "fp8")  # MoE expert weights on the device: the model dtype, or e4m3 + block scales


def _expert_leaf(path) -> bool:
    return str(path[-1]).startswith("experts_") and str(path[-1]).endswith("_proj")


def quantize_experts(params) -> Any:
    """Every MoE layer's expert weights (``experts_{gate,up,down}_proj``, the MTP layer's too) as float8_e4m3fn with
    one f32 scale per 128 x 128 block (``experts_*_proj_scale``), as GLM-5-FP8 checkpoints store them: the grouped
    matmul dequantises them block by block as it reads them, so decode reads half the expert bytes of bf16.
    Leaves already in FP8 are kept."""
    from flax.traverse_util import flatten_dict, unflatten_dict

    flat = dict(flatten_dict(params))
    for path in [p for p in flat if _expert_leaf(p) and flat[p].dtype != jnp.float8_e4m3fn]:
        flat[path], flat[scale_path(path)] = quantize_leaf(flat[path])
    return unflatten_dict(flat)


def quantizes(path, array, expert_weights: str) -> bool:
    """Whether the weight at ``path`` is one ``expert_weights`` keeps in FP8 and ``array`` is not yet."""
    return expert_weights == "fp8" and _expert_leaf(path) and array.dtype != jnp.float8_e4m3fn


def scale_path(path: tuple) -> tuple:
    """The path of an FP8 expert weight's block scales."""
    return path[:-1] + (path[-1] + "_scale",)


@jax.jit
def quantize_leaf(w):
    # One expert stack at a time, as it is made or read, so the model never exists in both precisions at once (one
    # program per stack shape: three per model).
    return _gmm.quantize_blocks(w)


def expert_weights_of(params) -> str:
    """"fp8" when the parameters hold FP8 experts, else "model"."""
    leaves = jax.tree_util.tree_leaves_with_path(params)
    return "fp8" if any(str(getattr(p[-1], "key", p[-1])).endswith("_proj_scale") for p, _ in leaves) else "model"


def param_shapes(cfg: ModelConfig, dtype, expert_weights: str = "model") -> Any:
    """The parameter pytree as ShapeDtypeStructs, without allocating anything."""
    if expert_weights not in EXPERT_WEIGHTS:
        raise ValueError(f"expert_weights must be one of {EXPERT_WEIGHTS}, got {expert_weights!r}")
    return _param_shapes(cfg, jnp.dtype(resolve_dtype(dtype)), expert_weights)


@functools.lru_cache(maxsize=32)
def _param_shapes(cfg: ModelConfig, dtype, expert_weights: str) -> Any:
    # Tracing the full GLM-5's init takes ~2 s, and a planner's table asks for the same shapes at every history
    # and machine; the result is immutable (ShapeDtypeStructs), so one trace per (config, dtype, experts) serves.
    module = GLM5(cfg, dtype)
    shapes = jax.eval_shape(lambda: _init_all(module, jax.random.key(0), *_dummy_inputs(cfg, dtype)))
    if expert_weights == "fp8":
        shapes = jax.eval_shape(quantize_experts, shapes)
    return shapes


_ONES = ("weight", "k_norm_weight")  # RMSNorm / LayerNorm scales
_ZEROS = ("k_norm_bias", "e_score_correction_bias")


# Leaves of more elements are drawn a block of rows at a time. One random.normal of a whole leaf held XLA's
# temporaries for all of it at once: ~9x the leaf's bfloat16 bytes on the CPU (16 GiB for the 154,880 x 6,144
# embedding of configs/h200_bench.py), so that benchmark config, whose weights fit a 24 GiB machine, was killed
# by the kernel's OOM killer minutes into drawing them. A block of 2^24 elements keeps them under ~0.3 GiB, and a
# leaf of that size or less is drawn whole, as before, so the tests' small models keep their values. (A GPU needs
# no blocks, but one path for every platform gives every platform the same weights.)
DRAW_BLOCK_ELEMENTS = 1 << 24
# What drawing one element holds beside the leaf until its block is written: its float32 value, its random bits
# and XLA's temporaries. A block of 2^24 elements raised the CPU's peak by 0.31 GiB over its bfloat16 leaf's bytes;
# an H100 held nothing beside the leaf, drawn whole or by blocks (XLA's GPU compiler fuses the draw into its output:
# experiments/results/probes/draw_peak_h100_86e22e0.json; ROCm's GPUs, also "gpu", not checked). Other platforms
# are counted as the CPU.
DRAW_BYTES_PER_ELEMENT = {"cpu": 20, "gpu": 0}


def draw_transient_bytes(leaves, platform: str = "cpu") -> int:
    """Memory a random draw of ``leaves`` (shapes) on a device of ``platform`` holds beside the leaves it made: one
    block's temporaries."""
    per = DRAW_BYTES_PER_ELEMENT.get(platform, DRAW_BYTES_PER_ELEMENT["cpu"])
    return per * min(DRAW_BLOCK_ELEMENTS, max(int(np.prod(x.shape)) for x in leaves))


@functools.partial(jax.jit, static_argnames=("shape", "dtype"))
def _normal_leaf(key, index, scale, *, shape, dtype):
    # One small program per leaf shape, shared by every leaf of that shape, every model and (through the persistent
    # compilation cache) every process: a single program filling all the leaves unrolled one random.normal per
    # leaf and compiled again for each config (0.3-4 s on the CPU, 23 s for a 16-layer model, ~0.5 s even to load
    # it from the persistent cache; 124 s of the test suite's compiling at e959171).
    return (scale * jax.random.normal(jax.random.fold_in(key, index), shape, jnp.float32)).astype(dtype)


@functools.partial(jax.jit, static_argnames=("rows", "block_rows"), donate_argnums=0)
def _normal_rows(out, key, index, block, start, scale, *, rows, block_rows):
    # Rows [start, start + block_rows) of ``out`` viewed as ``rows`` rows, drawn from fold_in(fold_in(key, index),
    # block), written in place (``out`` donated; the views are bitcasts).
    shape = out.shape
    flat = out.reshape(rows, -1)
    k = jax.random.fold_in(jax.random.fold_in(key, index), block)
    vals = (scale * jax.random.normal(k, (block_rows, flat.shape[1]), jnp.float32)).astype(out.dtype)
    return jax.lax.dynamic_update_slice(flat, vals, (start, 0)).reshape(shape)


def normal_leaf(key, index: int, scale, shape: tuple, dtype, on_block=None) -> jax.Array:
    """Leaf ``index``'s normal(0, ``scale``) values: drawn whole from ``fold_in(key, index)`` when it has at most
    ``DRAW_BLOCK_ELEMENTS`` elements; else viewed as rows (the leading axes; each row the trailing axes, at most a
    block), ``DRAW_BLOCK_ELEMENTS // row`` rows a block, block ``b`` drawn from ``fold_in(fold_in(key, index), b)``
    into the leaf in place. ``on_block(nbytes)`` after each block is filled (a progress bar)."""
    n = int(np.prod(shape))
    if n <= DRAW_BLOCK_ELEMENTS:
        return _normal_leaf(key, np.int32(index), scale, shape=tuple(shape), dtype=jnp.dtype(dtype))
    lead = next(k for k in range(1, len(shape) + 1) if np.prod(shape[k:], dtype=np.int64) <= DRAW_BLOCK_ELEMENTS)
    rows = int(np.prod(shape[:lead], dtype=np.int64))
    per = max(1, DRAW_BLOCK_ELEMENTS // (n // rows))
    out = jnp.zeros(shape, dtype)
    for block, start in enumerate(range(0, rows, per)):
        m = min(per, rows - start)
        out = _normal_rows(out, key, np.int32(index), np.int32(block), np.int32(start), scale, rows=rows,
                           block_rows=m)
        if on_block is not None:
            out.block_until_ready()
            on_block(m * (n // rows) * out.dtype.itemsize)
    return out


def init_params(cfg: ModelConfig, dtype, seed: int = 0, expert_weights: str = "model", *,
                progress: bool | None = None, place=None) -> Any:
    """Random parameters: normal(0, initializer_range) matrices, unit norm scales, zero biases (as transformers
    initialises GLM-5). Filled leaf by leaf from the shapes, so the model itself is never compiled for this; leaf
    ``i`` (in sorted path order) draws from ``fold_in(key(seed), i)``, a large one block by block
    (``normal_leaf``). ``expert_weights="fp8"``: the same values, each expert stack quantised as soon as it is
    drawn (``quantize_leaf``). ``progress``: a bar over the bytes filled (``glm53.progress``: by default once the
    fill has run 2 s; an 8.9B-parameter benchmark model takes minutes on a CPU, which printed nothing until it was
    done). ``place(path, array)``: where each leaf goes as
    soon as it is drawn (``glm53.sharding.Placement``: straight onto its devices)."""
    if expert_weights not in EXPERT_WEIGHTS:
        raise ValueError(f"expert_weights must be one of {EXPERT_WEIGHTS}, got {expert_weights!r}")
    from flax.traverse_util import flatten_dict, unflatten_dict

    from glm53 import progress as progress_lib

    progress_lib.check(progress)
    flat = flatten_dict(param_shapes(cfg, dtype))
    key = jax.random.key(seed)
    scale = np.float32(cfg.initializer_range)
    out = {}
    with progress_lib.bar(progress=progress, total=nbytes(flat), unit="B", unit_scale=True, unit_divisor=1024,
                          desc="random weights") as bar:
        for i, path in enumerate(sorted(flat)):
            s = flat[path]
            counted = []  # bytes of this leaf the bar has counted (a large leaf's, block by block)

            def on_block(n):
                counted.append(n)
                bar.update(n)

            if path[-1] in _ONES:
                out[path] = jnp.ones(s.shape, s.dtype)
            elif path[-1] in _ZEROS:
                out[path] = jnp.zeros(s.shape, s.dtype)
            else:
                out[path] = normal_leaf(key, i, scale, tuple(s.shape), s.dtype,
                                        on_block=None if bar.disable else on_block)
            made = [path]
            if quantizes(path, out[path], expert_weights):
                out[path], out[scale_path(path)] = quantize_leaf(out[path])
                made.append(scale_path(path))
            for p in made:
                if place is not None:
                    out[p] = place(p, out[p])
                if not bar.disable:  # the bar counts filled bytes, not dispatched ones
                    out[p].block_until_ready()
            bar.update(_leaf_bytes(s) - sum(counted))
    return unflatten_dict(out)


def num_params(params) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params))


def nbytes(params) -> int:
    """Bytes of a parameter tree: arrays, or ShapeDtypeStructs (counted before anything is allocated)."""
    return sum(_leaf_bytes(x) for x in jax.tree_util.tree_leaves(params))


def _leaf_bytes(x) -> int:
    return int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
