"""Every Pallas kernel lowers for the GPUs it is written for, checked on this CPU-only machine.

``jax.export`` can lower a function for another platform: for ``cuda`` and ``rocm`` that runs the Pallas-to-Triton
lowering of each kernel (everything but Triton's own compile to PTX / AMDGCN), which is where an unsupported
primitive, shape or indexing would fail. The interpreted kernels the other tests run check what the kernels
compute; this checks that the GPU path can be built at all, at the decode shapes of ``configs/h200_bench.py``.
"""

import functools
import importlib

import jax
import jax.numpy as jnp
import pytest
from jax import export

from kernels_pallas import kv_formats as kvf

gr = importlib.import_module("kernels_pallas.gather_rows")
it = importlib.import_module("kernels_pallas.indexer_topk")
hg = importlib.import_module("kernels_pallas.hot_gather")
fr = importlib.import_module("kernels_pallas.fill_rows")
frd = importlib.import_module("kernels_pallas.fill_round")

S = jax.ShapeDtypeStruct
I32 = jnp.int32
K, H, L, N = 2048, 32768, 9, 50176  # top-k, hot rows, cache layers (+ MTP), capacity at 50K


def _planes(fmt, *lead):
    """Abstract planes of ``fmt`` with leading dims ``lead``."""
    shapes = jax.eval_shape(functools.partial(kvf.pack, fmt), S((*lead, 512), jnp.float32),
                            S((*lead, 64), jnp.float32))
    return {n: S(v.shape, v.dtype) for n, v in shapes.items()}


def _cases():
    for fmt in kvf.KV_FORMATS:
        yield f"gather_rows_{fmt}", functools.partial(gr.gather_rows, kv_format=fmt, out_dtype=jnp.bfloat16), (
            _planes(fmt, L, N), S((1, K), I32))
    yield "indexer_scores", functools.partial(it.indexer_scores, softmax_scale=128 ** -0.5), (
        S((1, 1, 32, 128), jnp.bfloat16), S((1, 1, 32), jnp.float32), S((1, N, 128), jnp.bfloat16), S((1, 1), I32))
    yield "topk_positions", functools.partial(it.topk_positions, k=K), (S((1, 1, N), jnp.float32),)
    for fmt in kvf.KV_FORMATS:
        yield f"hot_gather_{fmt}", functools.partial(hg.hot_gather, kv_format=fmt, out_dtype=jnp.bfloat16,
                                                          block_rows=hg.DEFAULT_BLOCK_ROWS,
                                                          num_warps=hg.DEFAULT_NUM_WARPS), (
            S((K,), I32), S((K,), I32), _planes(fmt, L * 2048), _planes(fmt, L * H), _planes(fmt, 451584))
    layers = tuple(range(8))
    yield "fill_rows", functools.partial(fr.fill_rows, layers=layers, sessions=1, hot_rows=H), (
        _planes("q8g64", L * H), tuple(_planes("q8g64", K) for _ in layers), S((8, 1, K), I32), S((8, 1, K), I32),
        S((8, 1), I32))
    maps = dict(pin_round=S((L, 1, H), I32), position_of_slot=S((L, 1, H), I32), slot_of_position=S((L, 1, N), I32),
                rounds=S((L, 1), I32), clock=S((L, 1), I32), counters=S((L, 1, 5), I32))
    rnd = dict(pos=S((1, K), I32), source=S((1, K), I32), slot=S((1, K), I32), valid=S((1, K), jnp.bool_))
    yield "fill_round", functools.partial(frd.fill_round, layers=layers, hot_rows=H), (maps, (rnd,) * 8)


CASES = list(_cases())


@pytest.mark.parametrize("platform", ["cuda", "rocm"])
@pytest.mark.parametrize("name,fn,args", CASES, ids=[c[0] for c in CASES])
def test_kernel_lowers_for_gpu(platform, name, fn, args):
    exported = export.export(jax.jit(fn), platforms=[platform], disabled_checks=[
        export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)
    text = exported.mlir_module()
    # the kernel became a Triton call (not an XLA fallback), named as its pallas_call
    assert "__gpu$xla.gpu.triton" in text, name
