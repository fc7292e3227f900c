"""Planes with padding rows (``glm53.cache.addressable_planes``: a 1-byte plane that Pallas' Triton lowering would
misaddress gets rows past 2**32 bytes that nothing addresses, and the other planes of the same rows none): the row
kernels take planes of one set whose row counts differ, write only the rows they are asked to, and never touch the
padding. Interpreted on the CPU, compiled on a GPU; kernel == reference == a numpy oracle, bit for bit."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm53 import cache as gcache
from kernels_pallas import kv_formats as kvf

cb = importlib.import_module("kernels_pallas.copy_blocks")
fr = importlib.import_module("kernels_pallas.fill_rows")
hg = importlib.import_module("kernels_pallas.hot_gather")

INTERPRET = jax.default_backend() not in ("gpu", "cuda", "rocm")
FMT = "q8g64"
PAD = {"latent": 40, "scale": 0, "rope": 0}  # as the hot cache at the H200 target: the int8 plane alone


def _planes(rows: int, seed: int, pad: dict) -> dict:
    """Random ``{plane: [rows + pad[plane], W]}`` (no NaNs: XLA may canonicalise their payloads)."""
    rng = np.random.default_rng(seed)
    out = {}
    for n, (shape, dtype) in kvf.get_format(FMT).plane_shapes(rows).items():
        shape = (rows + pad[n], *shape[1:])
        if jnp.issubdtype(dtype, jnp.integer):
            out[n] = rng.integers(-128, 128, shape).astype(dtype)
        else:
            out[n] = rng.normal(size=shape).astype(dtype)
    return out


def test_padded_rows_arithmetic():
    i8, bf16 = np.dtype(np.int8), np.dtype(jnp.bfloat16)
    assert gcache.padded_rows(2**22 - 1, (512,), i8) == 2**22 - 1  # below 2**31 elements: as it is
    assert gcache.padded_rows(2**22, (512,), i8) == 2**23 + 1  # 2**31 elements: just past 2**32 bytes
    assert gcache.padded_rows(2**23, (512,), i8) == 2**23 + 1  # 2**32 bytes exactly: still 32-bit offsets
    assert gcache.padded_rows(2**23 + 1, (512,), i8) == 2**23 + 1
    assert gcache.padded_rows(2**22 - 1, (512,), bf16) == 2**22 - 1  # 2-byte planes: below 2**31 elements,
    assert gcache.padded_rows(2**23, (512,), bf16) == 2**23  # or past 2**32 bytes, as they are; only exactly
    assert gcache.padded_rows(2**22, (512,), bf16) == 2**22 + 1  # 2**31 elements in 2**32 bytes, as the check says
    assert gcache.padded_rows(90, (54272, 512), i8) == 155  # resident planes of N rows
    fmt = kvf.get_format(FMT)
    shapes = gcache.addressable_planes(fmt, 2**22 + 5)
    assert shapes["latent"][0] == (2**23 + 1, 512) and shapes["rope"][0] == (2**22 + 5, 64)
    assert shapes["scale"][0] == (2**22 + 5, 8)
    uniform = gcache.addressable_planes(fmt, 2**22 + 5, uniform=True)
    assert {s[0] for s, _ in uniform.values()} == {2**23 + 1}
    for s, d in (*shapes.values(), *uniform.values()):
        assert not hg.triton_misaddressed(s, d)
    # fp8 latents are 1-byte too
    assert gcache.addressable_planes(kvf.get_format("fp8g128"), 2**22)["latent"][0] == (2**23 + 1, 512)
    assert gcache.addressable_planes(kvf.get_format("bf16"), 2**22 + 64)["latent"][0] == (2**22 + 64, 512)


@pytest.mark.parametrize("dst_on", ["padded", "plain"])
def test_copy_blocks_with_planes_of_different_rows(dst_on):
    """Ring <-> pool copies (copyback, rollback, restore): either side may carry padding in one plane."""
    rows_src, rows_dst, B = 96, 80, 16
    src = _planes(rows_src, 0, PAD if dst_on == "plain" else dict.fromkeys(PAD, 0))
    dst = _planes(rows_dst, 1, PAD if dst_on == "padded" else dict.fromkeys(PAD, 0))
    src_start = np.array([0, 40, 80, 17], np.int32)
    dst_start = np.array([0, 16, 64, 48], np.int32)
    count = np.array([16, 9, 16, 0], np.int32)
    want = {n: v.copy() for n, v in dst.items()}
    for s, d, c in zip(src_start, dst_start, count):
        for n in want:
            want[n][d:d + c] = src[n][s:s + c]
    args = ({n: jnp.asarray(v) for n, v in src.items()}, jnp.asarray(src_start), jnp.asarray(dst_start),
            jnp.asarray(count))
    got = cb.copy_blocks({n: jnp.asarray(v) for n, v in dst.items()}, *args, block_size=B, block_rows=8,
                         interpret=INTERPRET)
    ref = cb.copy_blocks_reference({n: jnp.asarray(v) for n, v in dst.items()}, *args, block_size=B, block_rows=8)
    for n in want:
        assert got[n].shape == dst[n].shape
        np.testing.assert_array_equal(np.asarray(got[n]), want[n], err_msg=n)  # padding rows included: untouched
        np.testing.assert_array_equal(np.asarray(ref[n]), want[n], err_msg=n)


def test_fill_rows_into_a_padded_hot_plane():
    L, S, H, B, E, F = 3, 2, 32, 2, 24, 16
    layers = (0, 2)
    hot = _planes(L * S * H, 2, PAD)
    rows = tuple({n: jnp.asarray(v) for n, v in _planes(B * E, 3 + i, dict.fromkeys(PAD, 0)).items()}
                 for i in range(len(layers)))
    rng = np.random.default_rng(4)
    entry = np.stack([np.stack([rng.permutation(E)[:F] for _ in range(B)]) for _ in layers]).astype(np.int32)
    victim = np.stack([np.stack([rng.permutation(H)[:F] for _ in range(B)]) for _ in layers]).astype(np.int32)
    n_fill = np.array([[5, 16], [0, 9]], np.int32)
    lane_slot = np.array([1, 0], np.int32)
    want = {n: v.copy() for n, v in hot.items()}
    for i, layer in enumerate(layers):
        for b in range(B):
            for f in range(n_fill[i, b]):
                for n in want:
                    want[n][(layer * S + lane_slot[b]) * H + victim[i, b, f]] = np.asarray(rows[i][n])[b * E +
                                                                                                     entry[i, b, f]]
    kw = dict(layers=layers, sessions=S, hot_rows=H, block_rows=8)
    args = (rows, jnp.asarray(entry), jnp.asarray(victim), jnp.asarray(n_fill), jnp.asarray(lane_slot))
    got = fr.fill_rows({n: jnp.asarray(v) for n, v in hot.items()}, *args, interpret=INTERPRET, **kw)
    ref = fr.fill_rows_reference({n: jnp.asarray(v) for n, v in hot.items()}, *args, **kw)
    for n in want:
        assert got[n].shape == hot[n].shape
        np.testing.assert_array_equal(np.asarray(got[n]), want[n], err_msg=n)
        np.testing.assert_array_equal(np.asarray(ref[n]), want[n], err_msg=n)
    # fewer rows than the slots need: refused
    short = {n: jnp.asarray(v[:L * S * H - 1]) for n, v in hot.items()}
    with pytest.raises(ValueError, match="hot plane"):
        fr.fill_rows_reference(short, *args, **kw)


def test_resident_history_with_padding_planes(monkeypatch):
    """The resident history as ``[L * S + pad, N, W]`` planes: writes (an inactive lane writes nothing), fork's
    copy, save's read, restore's write and the gather do the same with padding planes as without, and never touch
    them."""
    from glm53.cache import Lanes, init_resident
    from glm53.config import CacheConfig, ModelConfig
    from glm53.model import make_step

    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=32, moe_intermediate_size=16,
                      num_hidden_layers=2, first_k_dense_replace=2, num_attention_heads=2, q_lora_rank=16,
                      qk_nope_head_dim=8, v_head_dim=8, index_n_heads=2, index_topk=8,
                      indexer_types=("full", "shared"), n_routed_experts=2, num_experts_per_tok=1,
                      num_nextn_predict_layers=0, max_position_embeddings=1024)
    cc = CacheConfig(mode="resident", kv_format=FMT)
    L, S, N, T, K = cfg.num_cache_layers, 5, 128, 8, 8
    rng = np.random.default_rng(7)
    latent = jnp.asarray(rng.normal(size=(L, 3, T, 512)), jnp.float32)
    rope = jnp.asarray(rng.normal(size=(L, 3, T, 64)), jnp.float32)
    sel = jnp.asarray(rng.integers(0, T, (3, 1, K)), jnp.int32)

    @jax.jit
    def run(cache):
        lanes = Lanes(slot=jnp.asarray([2, 0, 1], jnp.int32), active=jnp.asarray([True, True, False]))
        step = make_step(jnp.zeros((3,), jnp.int32), jnp.asarray([T, T - 3, T], jnp.int32), T, N, cfg, jnp.float32,
                         lanes, kernels="auto")
        for layer in range(L):
            cache = cache.write_rows(layer, latent[layer], rope[layer], step)
        cache = cache.copy_slot(jnp.int32(2), jnp.int32(3))
        rows = cache.read_slot_rows(jnp.int32(0), "auto")
        cache = cache.write_slot_rows(jnp.int32(4), rows, jnp.int32(T), jnp.int32(T), "auto")
        reads = [cache.gather_rows(layer, sel, None, step, jnp.float32)[:2] for layer in range(L)]
        return cache, rows, reads

    want = run(init_resident(cfg, cc, S, N, jnp.float32))
    real = gcache.padded_rows
    monkeypatch.setattr(gcache, "padded_rows", lambda rows, row_shape, dtype: real(rows, row_shape, dtype) + (
        3 if np.dtype(dtype).itemsize == 1 else 0))
    cache = init_resident(cfg, cc, S, N, jnp.float32)
    assert {v.shape[0] for v in cache.history.values()} == {L * S + 3}  # every plane: one shape (gather_rows)
    got = run(cache)
    for n, v in want[0].history_planes().items():
        np.testing.assert_array_equal(np.asarray(got[0].history_planes()[n]), np.asarray(v), err_msg=n)
        assert not np.asarray(got[0].history[n])[L * S:].any(), f"a padding plane of {n} was written"
    for n, v in got[0].history_planes().items():
        v = np.asarray(v)
        assert not v[:, 1].any()  # the inactive lane's slot: nothing written
        assert v[:, 2].any() and (v[:, 3] == v[:, 2]).all() and (v[:, 4] == v[:, 0]).all()  # fork; restore
    for g, w in zip(jax.tree.leaves(got[1:]), jax.tree.leaves(want[1:])):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_transient_device_buffers_are_padded_too():
    """The buffers that bulk reads, saves and forks copy pages into are kernel operands as well: a save of a
    ~470K-row session (9 layers) would be an int8 latent plane of 2**31..2**32 elements, so it gets padding rows
    (and nothing else does)."""
    import jax
    import jax.numpy as jnp

    from glm53 import offload

    planes = {"latent": jax.ShapeDtypeStruct((64, 512), jnp.int8), "rope": jax.ShapeDtypeStruct((64, 64), jnp.bfloat16)}
    rows = 9 * 470_016
    buf = jax.eval_shape(lambda: offload._device_buffer(planes, rows))
    assert buf["latent"].shape == (2**32 // 512 + 1, 512)  # past 2**32 bytes: 64-bit offsets
    assert buf["rope"].shape == (rows, 64)
    small = jax.eval_shape(lambda: offload._device_buffer(planes, 1000))
    assert small["latent"].shape == (1000, 512)
