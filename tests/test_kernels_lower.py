"""Every Pallas kernel lowers for the GPUs it is written for, checked on this CPU-only machine.

``jax.export`` can lower a function for another platform: for ``cuda`` and ``rocm`` that runs the Pallas-to-Triton
lowering of each kernel (everything but Triton's own compile to PTX / AMDGCN), which is where an unsupported
primitive, shape or indexing would fail. The interpreted kernels the other tests run check what the kernels
compute; this checks that the GPU path can be built at all, at the decode shapes of ``configs/h200_bench.py``
(4 session slots, 4 lanes), with host-memory operands where the offload cache has them.
"""

import functools
import importlib

import jax
import jax.numpy as jnp
import pytest
from jax import export
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from kernels_pallas import kv_formats as kvf

gr = importlib.import_module("kernels_pallas.gather_rows")
it = importlib.import_module("kernels_pallas.indexer_topk")
hg = importlib.import_module("kernels_pallas.hot_gather")
fr = importlib.import_module("kernels_pallas.fill_rows")
frd = importlib.import_module("kernels_pallas.fill_round")
cb = importlib.import_module("kernels_pallas.copy_blocks")
gm = importlib.import_module("kernels_pallas.grouped_matmul")
mla = importlib.import_module("kernels_pallas.mla_decode")

S = jax.ShapeDtypeStruct
I32 = jnp.int32
K, H, L, N = 2048, 32768, 9, 50176  # top-k, hot rows, cache layers (+ MTP), capacity at 50K
SLOTS, B, T = 4, 4, 4  # session slots, lanes of the step, MTP verify rows
P, POOL_PAGES = 64, 2048  # copyback_every (rows per page), pages in the host pool
# pinned_host operands: the aval's memory space comes from a NamedSharding's memory kind
HOST = NamedSharding(Mesh(jax.devices()[:1], ("x",)), PartitionSpec(), memory_kind="pinned_host")


def _planes(fmt, *lead, sharding=None):
    """Abstract planes of ``fmt`` with leading dims ``lead``."""
    shapes = jax.eval_shape(functools.partial(kvf.pack, fmt), S((*lead, 512), jnp.float32),
                            S((*lead, 64), jnp.float32))
    return {n: S(v.shape, v.dtype, sharding=sharding) for n, v in shapes.items()}


def _fill_round_args(M):
    maps = dict(pin_round=S((L, SLOTS, H), I32), position_of_slot=S((L, SLOTS, H), I32),
                slot_of_position=S((L, SLOTS, N), I32), rounds=S((L, SLOTS), I32), clock=S((L, SLOTS), I32),
                counters=S((L, SLOTS, 5), I32))
    rnd = dict(pos=S((B, M), I32), source=S((B, M), I32), slot=S((B, M), I32), valid=S((B, M), jnp.bool_))
    return maps, (rnd,) * 8, S((B,), I32), S((B,), jnp.bool_)


def _cases():
    for fmt in kvf.KV_FORMATS:
        yield f"gather_rows_{fmt}", functools.partial(gr.gather_rows, kv_format=fmt, out_dtype=jnp.bfloat16), (
            _planes(fmt, L * SLOTS, N), S((B,), I32), S((B, K), I32))
    yield "indexer_scores", functools.partial(it.indexer_scores, softmax_scale=128 ** -0.5), (
        S((B, 1, 32, 128), jnp.bfloat16), S((B, 1, 32), jnp.float32), S((L * SLOTS, N, 128), jnp.bfloat16),
        S((B,), I32), S((B, 1), I32))
    yield "topk_positions", functools.partial(it.topk_positions, k=K), (S((B, 1, N), jnp.float32),)
    # prefill chunk: queries in blocks, heads accumulated one by one; the top-k bounded by the query positions
    TC = 2 * it.CHUNK_QUERIES
    yield "indexer_scores_chunk", functools.partial(it.indexer_scores, softmax_scale=128 ** -0.5), (
        S((1, TC, 32, 128), jnp.bfloat16), S((1, TC, 32), jnp.float32), S((L * SLOTS, N, 128), jnp.bfloat16),
        S((1,), I32), S((1, TC), I32))
    yield "topk_positions_causal", lambda x, qpos: it.topk_positions(x, K, qpos), (
        S((1, TC, N), jnp.float32), S((1, TC), I32))
    # the blocks' counts summed in place by atomic adds: decode lanes and a causal prefill chunk
    yield "topk_positions_atomic", functools.partial(it.topk_positions, k=K, block_totals="atomic"), (
        S((B, 1, N), jnp.float32),)
    yield "topk_positions_causal_atomic", lambda x, qpos: it.topk_positions(x, K, qpos, block_totals="atomic"), (
        S((1, TC, N), jnp.float32), S((1, TC), I32))
    # FP8 keys with their scales, in both kernels, at fp8 precision
    for name, t in (("decode", T), ("chunk", TC)):
        yield f"indexer_scores_fp8_{name}", functools.partial(it.indexer_scores, softmax_scale=128 ** -0.5,
                                                              precision="fp8"), (
            S((1, t, 32, 128), jnp.bfloat16), S((1, t, 32), jnp.float32),
            S((L * SLOTS, N, 128), jnp.float8_e4m3fn), S((1,), I32), S((1, t), I32),
            S((L * SLOTS, N), jnp.float32))
    # keys as the caches store them, their bits (kv_formats.stored_dtype): bf16 in a decode step, fp8 in a chunk
    yield "indexer_scores_stored_bf16", functools.partial(it.indexer_scores, softmax_scale=128 ** -0.5,
                                                          key_dtype=jnp.dtype(jnp.bfloat16)), (
        S((B, 1, 32, 128), jnp.bfloat16), S((B, 1, 32), jnp.float32), S((L * SLOTS, N, 128), jnp.uint16),
        S((B,), I32), S((B, 1), I32))
    yield "indexer_scores_stored_fp8_chunk", functools.partial(it.indexer_scores, softmax_scale=128 ** -0.5,
                                                               precision="fp8",
                                                               key_dtype=jnp.dtype(jnp.float8_e4m3fn)), (
        S((1, TC, 32, 128), jnp.bfloat16), S((1, TC, 32), jnp.float32), S((L * SLOTS, N, 128), jnp.uint8),
        S((1,), I32), S((1, TC), I32), S((L * SLOTS, N), jnp.float32))
    for fmt in kvf.KV_FORMATS:
        yield f"hot_gather_{fmt}", functools.partial(hg.hot_gather, kv_format=fmt, out_dtype=jnp.bfloat16,
                                                          block_rows=hg.DEFAULT_BLOCK_ROWS,
                                                          num_warps=hg.DEFAULT_NUM_WARPS), (
            S((B * K,), I32), S((B * K,), I32), _planes(fmt, L * SLOTS * 2048), _planes(fmt, L * SLOTS * H),
            _planes(fmt, POOL_PAGES * L * P, sharding=HOST))
    layers = tuple(range(8))
    for fmt in kvf.KV_FORMATS:  # fp8 planes: masked loads must not need an fp8 fill constant
        yield f"fill_rows_{fmt}", functools.partial(fr.fill_rows, layers=layers, sessions=SLOTS, hot_rows=H), (
            _planes(fmt, L * SLOTS * H), tuple(_planes(fmt, B * K) for _ in layers), S((8, B, K), I32),
            S((8, B, K), I32), S((8, B), I32), S((B,), I32))
    # an MTP-3 verify step: 8 layers' rounds of T rows and the MTP layer's of its 3 drafts, each at its own width
    yield "fill_rows_verify_widths", functools.partial(fr.fill_rows, layers=tuple(range(L)), sessions=SLOTS,
                                                       hot_rows=H), (
        _planes("q8g64", L * SLOTS * H), tuple(_planes("q8g64", B * T * K) for _ in layers)
        + (_planes("q8g64", B * 3 * K),), S((L, B, T * K), I32), S((L, B, T * K), I32), S((L, B), I32), S((B,), I32))
    yield "fill_round", functools.partial(frd.fill_round, layers=layers, hot_rows=H), _fill_round_args(K)
    # MTP verify: T rows' selections in one round, positions repeated up to T times
    yield "fill_round_repeats", functools.partial(frd.fill_round, layers=layers, hot_rows=H, distinct=False,
                                                  max_repeats=T), _fill_round_args(T * K)
    # MoE experts (configs/h200_bench.py widths): a decode step's 4 lanes x 8 routed rows, and a prefill chunk
    for rows in (B * 8, 1024 * 8):
        yield f"grouped_matmul_{rows}", gm.grouped_matmul, (
            S((rows, 6144), jnp.bfloat16), S((16, 6144, 2048), jnp.bfloat16), S((16,), I32))
        yield f"grouped_matmul_fp8_{rows}", gm.grouped_matmul, (  # FP8 experts, block scales read in the kernel
            S((rows, 6144), jnp.bfloat16), S((16, 6144, 2048), jnp.float8_e4m3fn), S((16,), I32),
            S((16, 48, 16), jnp.float32))
        yield f"grouped_swiglu_{rows}", gm.grouped_swiglu, (  # gate and up in one launch
            S((rows, 6144), jnp.bfloat16), S((16, 6144, 2048), jnp.bfloat16), S((16, 6144, 2048), jnp.bfloat16),
            S((16,), I32))
        yield f"grouped_swiglu_fp8_{rows}", gm.grouped_swiglu, (
            S((rows, 6144), jnp.bfloat16), S((16, 6144, 2048), jnp.float8_e4m3fn),
            S((16, 6144, 2048), jnp.float8_e4m3fn), S((16,), I32), S((16, 48, 16), jnp.float32),
            S((16, 48, 16), jnp.float32))
    # sparse MLA attention (64 heads, latent 512, rope 64, top-k 2,048): a decode step's lanes, a verify step's rows
    for q in (B, B * T):
        yield f"mla_decode_{q}", functools.partial(mla.mla_decode, softmax_scale=192 ** -0.5), (
            S((q, 64, 512), jnp.bfloat16), S((q, 64, 64), jnp.bfloat16), S((q, K, 512), jnp.bfloat16),
            S((q, K, 64), jnp.bfloat16), S((q, K), jnp.bool_))
    ring, pool = _planes("fp8g128", L * SLOTS * 2 * P), _planes("fp8g128", POOL_PAGES * L * P, sharding=HOST)
    NB = B * L * 2  # two pages per lane and layer
    idx = (S((NB,), I32),) * 3
    copy = functools.partial(cb.copy_blocks, block_size=P)
    yield "copy_blocks_to_host", copy, (pool, ring, *idx)  # copyback: ring rows into the host pool
    yield "copy_blocks_from_host", copy, (_planes("fp8g128", B * N), pool, *idx)  # bulk read into a device buffer


CASES = list(_cases())


@pytest.mark.parametrize("platform", ["cuda", "rocm"])
@pytest.mark.parametrize("name,fn,args", CASES, ids=[c[0] for c in CASES])
def test_kernel_lowers_for_gpu(platform, name, fn, args):
    exported = export.export(jax.jit(fn), platforms=[platform], disabled_checks=[
        export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)
    text = exported.mlir_module()
    # the kernel became a Triton call (not an XLA fallback), named as its pallas_call
    assert "__gpu$xla.gpu.triton" in text, name
    if any(getattr(a, "sharding", None) is HOST for a in jax.tree.leaves(args)):
        assert 'mhlo.memory_kind = "pinned_host"' in text, "the host operand reaches the kernel where it lives"


@pytest.mark.parametrize("platform", ["cuda", "rocm"])
def test_topk_atomic_totals_lower_to_integer_adds(platform, monkeypatch, capsys):
    """The atomic top-k's totals are int32 counts: every atomic in its Triton IR must be an integer add. JAX's lowering
    takes a vector of int32 for a float (``fadd`` on the integers' bits), which the interpreter cannot show and the
    H200 turned into zero totals (7156d33), so the IR itself is checked. The shape is this test's own: ``debug`` is
    part of the traced pallas_call, and a trace cached by another test would print nothing."""
    monkeypatch.setattr(it.pl, "pallas_call", functools.partial(it.pl.pallas_call, debug=True))
    export.export(jax.jit(functools.partial(it.topk_positions, k=64, block_totals="atomic")), platforms=[platform],
                  disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
        S((3, 1, 5000), jnp.float32))
    rmw = [line for line in capsys.readouterr().out.splitlines() if "tt.atomic_rmw" in line]
    assert rmw and all("tt.atomic_rmw add," in line for line in rmw), rmw[:2]
    assert len(rmw) == 8 * 16, "one scalar add per radix pass and candidate"


def test_topk_glue_between_kernels_is_one_reduction_a_pass():
    """The "xla" top-k launches 10 kernels (8 radix passes, the tie count, the compact) and between two passes XLA
    does only the digit's reduction: the candidates, the threshold's prefix and sign, the digit's ``- 1`` and the
    blocks' offsets are computed in the kernels. Each elementwise op left between them became a launch of its own on
    the H200 (582 -> 541 kernels a batch-1 step once they moved in: ``probes/profile_decode_8k_model_*.json``), so the
    lowered program must have none of the ops that built them."""
    exported = export.export(jax.jit(lambda x, qpos: it.topk_positions(x, K, qpos)), platforms=["cuda"],
                             disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
        S((B, 1, N), jnp.float32), S((B, 1), I32))
    text = exported.mlir_module()
    for op in ("stablehlo.xor", "stablehlo.or", "stablehlo.shift_left", "stablehlo.subtract",
               "stablehlo.bitcast_convert"):
        assert op not in text, f"{op} between the top-k's kernels"
    # one Triton kernel per pass (each pass's candidates are static in its kernel), the tie count and the compact
    assert text.count("__gpu$xla.gpu.triton") == 10
