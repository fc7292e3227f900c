"""The engine's compiled decode, verify and draft steps update the cache in place: no copy of a cache buffer.

A step donates the cache and scatters into it (ring / history rows, indexer keys, the fill's maps). When a step
reads a buffer and later writes it with nothing making the write depend on the read, XLA keeps the old contents
alive by copying the whole buffer first. Before this test the decode step did that twice to the offload ring (the
copyback's read of it against layer 0's write; the last layer's reads against the MTP layer's write): two ~94 MB
copies, 86 us of a ~5 ms step at 10 sessions on the H200 (``experiments/results/profile_decode_50k_b10_43c288c.json``);
and the reference fill copied ``position_of_slot``. An optimization barrier does not prevent it (it is removed
before copy insertion); a data dependency does: decode writes the MTP row first, decode and verify copy back after
layer 0's ring write (``OffloadCache.begin_step``), the fill's update depends on its read.

Chunk steps (prefill, append) copy back first and so copy the ring once per chunk (their rows would not fit the
ring beside the rows being copied); they are not checked. Per-slot session scalars (``sessions.lengths`` and the
like, a few bytes per slot) are left out on a CPU, whose compiler copies them even in the resident step (each read
of them is ordered before the write there too); on a GPU no cache parameter may be copied at all: a copy is a ~1 us
kernel, and the offload decode step had six, of ``host_len``, ``lengths`` and ``mtp_lengths``
(``glm53.offload.OffloadCache._copyback``, ``glm53.steps.decode``). This tiny config did not show the four of
``lengths`` and ``mtp_lengths`` that the 10-lane ``configs/h200_bench.py`` step kept (XLA scheduled it otherwise);
the profile's HLO did (``experiments.profile_decode`` writes it beside its JSON).

The steps are compiled with this backend's kernels (references on a CPU, the Pallas kernels compiled on a GPU) and
their HLO searched for a copy whose result has the type of a cache buffer, and for a float32 array as large as a
cache buffer of bf16 values (XLA:CPU's way of computing on bf16: convert the whole buffer, which the caches avoid by
storing such values as their bits, ``kernels_pallas.kv_formats``)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import glm53
from glm53.config import CacheConfig
from engine_common import MESH_CFG as CFG
from experiments.trace_util import copied_cache_params

_HLO_DTYPE = {"int8": "s8", "int16": "s16", "int32": "s32", "uint32": "u32", "uint16": "u16", "uint8": "u8",
              "float32": "f32", "bfloat16": "bf16", "float8_e4m3fn": "f8e4m3fn", "bool": "pred"}


def _buffer_types(cache) -> dict:
    """``{HLO type: cache field}`` of every cache buffer but the per-slot session scalars."""
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(cache):
        name = jax.tree_util.keystr(path)
        if name.startswith(".sessions") or np.prod(leaf.shape) < 256:
            continue
        out[f"{_HLO_DTYPE[str(leaf.dtype)]}[{','.join(map(str, leaf.shape))}]"] = name
    return out


def _widened(compiled_text: str, cache, params) -> list:
    """Cache buffers of bf16 or fp8 values (stored as their bits: kernels_pallas.kv_formats) that the step converts
    whole to float32: XLA:CPU computes on bf16 and fp8 arrays that way (convert, compute, convert back), which made
    every one-row write into a bf16 buffer cost the whole cache. Found by shape: a buffer whose shape a weight has
    too (the embedding's [256, 64] is the offload ring's rope plane's) is left out."""
    weights = {",".join(map(str, w.shape)) for w in jax.tree_util.tree_leaves(params)}
    narrow = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(cache):
        shape = ",".join(map(str, leaf.shape))
        if np.prod(leaf.shape) >= 256 and leaf.dtype in (jnp.uint16, jnp.uint8, jnp.bfloat16, jnp.float8_e4m3fn) \
                and shape not in weights:
            narrow[shape] = jax.tree_util.keystr(path)
    assert narrow, "this cache stores no bf16 or fp8 buffer: the check would pass whatever the step does"
    return sorted({f"{narrow[m.group(1)]} (f32[{m.group(1)}])"
                   for m in re.finditer(r"= f32\[([0-9,]+)\]\{[^}]*\} convert\(", compiled_text)
                   if m.group(1) in narrow})


def _copied(compiled_text: str, types: dict) -> list:
    hits = []
    if jax.default_backend() != "cpu":  # any copy of a cache parameter, whatever its size
        hits += copied_cache_params(compiled_text)
    # A copy of a broadcast materialises a fresh buffer (the bulk read's zeroed one), not a cache buffer.
    for m in re.finditer(r"= (\w+\[[0-9,]*\])\{[^}]*\} copy\(%(\w+)", compiled_text):
        if m.group(1) in types and not re.match(r"(wrapped_)?(broadcast|constant)", m.group(2)):
            hits.append(f"{types[m.group(1)]} ({m.group(1)})")
    return hits


@pytest.mark.parametrize("mode", ["resident", "offload"])
def test_steps_copy_no_cache_buffer(mode):
    cc = CacheConfig(mode=mode, kv_format="q8g64", prefill_chunk=16, copyback_every=16, hot_rows=64, max_len=128)
    model = glm53.from_config(CFG, seed=0, dtype="bfloat16", cache_config=cc)
    e = glm53.Engine(model, max_sessions=2)
    lanes = e._lanes([0, 1])[0]
    B, D = 2, 2
    i32 = jnp.zeros((B,), jnp.int32)
    stop = jnp.full((4,), -1, jnp.int32)
    pages = glm53.offload.copy_pages_for(cc, 1) if mode == "offload" else 0
    f0, f1 = jnp.float32(0), jnp.float32(1)
    calls = {
        "decode": ((model.params, e.cache, lanes, i32, i32, jnp.int32(0), f0, f1, stop, None),
                   dict(greedy=True, kernels=e.kernels, copy_pages=pages)),
        # plain decode's variant without the copyback (the engine's steps where no page can be due)
        "decode_copy_free": ((model.params, e.cache, lanes, i32, i32, jnp.int32(0), f0, f1, stop, None),
                             dict(greedy=True, kernels=e.kernels, copy_pages=0)),
        # the benchmarks' selection override (experiments.workloads), as profile_decode compiles it
        "decode_selected": ((model.params, e.cache, lanes, i32, i32, jnp.int32(0), f0, f1, stop,
                             jnp.zeros((B, CFG.index_topk), jnp.int32)),
                            dict(greedy=True, kernels=e.kernels, copy_pages=0)),
        "verify": ((model.params, e.cache, lanes, i32, jnp.zeros((B, D), jnp.int32), None, i32, jnp.int32(0), f0, f1,
                    stop, None),
                   dict(greedy=True, accept_override=None, kernels=e.kernels, copy_pages=pages)),
        "draft": ((model.params, e.cache, lanes, i32, jnp.int32(0), f0, f1),
                  dict(depth=D, greedy=True, kernels=e.kernels)),
    }
    types = _buffer_types(e.cache)
    assert any("ring" in n or "history" in n for n in types.values()), types
    copies, widened = {}, {}
    for name, (args, kw) in calls.items():
        step = model.steps.for_cache(name.split("_")[0], e.cache)
        text = step.lower(*args, **kw).compile().as_text()
        copies[name], widened[name] = _copied(text, types), _widened(text, e.cache, model.params)
    assert copies == {name: [] for name in calls}, copies
    assert widened == {name: [] for name in calls}, widened
