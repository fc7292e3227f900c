"""The engine's steps (decode, verify, draft, chunk), lowered for CUDA with the Pallas kernels, contain no while loop.

XLA's GPU runtime runs a while loop by deciding each iteration on the host: a launch and a device-to-host read of
the predicate per iteration, outside command buffers. In a decode step that is a stall per iteration, every step (a
``jnp.searchsorted`` in the grouped matmul's schedule was one: five iterations per matmul, three matmuls per MoE
layer). Loops with a fixed trip count are unrolled in Python instead (the radix top-k's passes) and searches use
``method="compare_all"``. Lowered with ``jax.export`` on the CPU (the Triton lowering runs without a GPU), with the
kernel dispatch forced to the GPU path."""

import functools
import re

import jax
import jax.numpy as jnp
import pytest
from jax import export

import glm53
import kernels_pallas.ops as ops
from glm53 import steps as St
from glm53.config import CacheConfig
from engine_common import MESH_CFG as CFG


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if isinstance(x, jax.Array) else x, tree)


@pytest.mark.parametrize("mode", ["resident", "offload"])
def test_gpu_steps_have_no_while_loops(mode, monkeypatch):
    cc = CacheConfig(mode=mode, kv_format="q8g64", prefill_chunk=16, copyback_every=16, hot_rows=64, max_len=128)
    model = glm53.from_config(CFG, seed=0, dtype="bfloat16", cache_config=cc)
    e = glm53.Engine(model, max_sessions=2)
    cache = _abstract(e.cache)
    params = _abstract(model.params)
    B, D = 2, 2
    lanes = _abstract(e._lanes([0, 1])[0])
    i32 = jax.ShapeDtypeStruct((B,), jnp.int32)
    stop = jax.ShapeDtypeStruct((4,), jnp.int32)
    f32 = jnp.float32(0)
    pages = glm53.offload.copy_pages_for(cc, 1) if mode == "offload" else 0
    monkeypatch.setattr(ops, "resolve", lambda impl: (impl != "reference", False))  # the GPU path, compiled
    calls = {
        "decode": (functools.partial(St.decode, model.steps.net, greedy=True, kernels="pallas", copy_pages=pages),
                   (params, cache, lanes, i32, i32, jnp.int32(0), f32, jnp.float32(1), stop, None)),
        "verify": (functools.partial(St.verify, model.steps.net, greedy=True, accept_override=None, kernels="pallas",
                                     copy_pages=pages),
                   (params, cache, lanes, i32, jax.ShapeDtypeStruct((B, D), jnp.int32), None, i32, jnp.int32(0), f32,
                    jnp.float32(1), stop, None)),
        "draft": (functools.partial(St.draft, model.steps.net, depth=D, greedy=True, kernels="pallas"),
                  (params, cache, lanes, i32, jnp.int32(0), f32, jnp.float32(1))),
        "chunk": (functools.partial(St.chunk, model.steps.net, outputs="hidden", kernels="pallas",
                                    bulk=mode == "offload", copy_pages=pages),
                  (params, cache, lanes, jax.ShapeDtypeStruct((B, 16), jnp.int32), i32)),
    }
    loops = {}
    for name, (fn, args) in calls.items():
        text = export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=[
            export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args).mlir_module()
        assert "__gpu$xla.gpu.triton" in text  # the kernels are in it, compiled, not interpreted
        loops[name] = len(re.findall(r"stablehlo\.while", text))
    assert loops == {name: 0 for name in calls}, loops
