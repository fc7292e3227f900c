"""The host pool at scale (16 sessions x 1,048,576 rows x 9 cache layers: 151M pool rows, a 77 GB int8 latent plane).

Row indices stay int32 (below 2**31 rows per array, which ``glm53.offload.validate`` enforces) while byte offsets pass
2**31 and 2**32; the kernels' offsets are Pallas' Triton lowering's, 64-bit for operands past 2**32 bytes
(``kernels_pallas.hot_gather``, "Addressing"). Checked here:

* the hot gather (interpreted, and its reference) reads host rows whose byte offset is past 2**31 from an int8
  plane of more than 2**31 elements (2.1 GB; written sparse in NumPy, only the rows read hold data);
* on a GPU, the compiled hot gather reads, and the compiled copy kernel writes, a pinned_host pool of more than
  4 GiB allocated by ``allocate_pool`` (the same path on a small pool runs everywhere, interpreted on the CPU);
* the Triton lowering of the kernels at the target pool size uses 64-bit offsets for the pool planes (CPU: the
  kernels are lowered for CUDA without a GPU) and the compiled kernels refuse planes they would misaddress;
* ``validate`` refuses sizes whose arrays would outgrow int32 row indices; the pool is allocated zero in pinned_host
  memory.
"""

import functools
import importlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import glm53
from glm53 import offload
from glm53.config import ConfigError
from kernels_pallas import kv_formats as kvf
from kernels_pallas import ops

hg = importlib.import_module("kernels_pallas.hot_gather")
cb = importlib.import_module("kernels_pallas.copy_blocks")
frd = importlib.import_module("kernels_pallas.fill_round")
fr = importlib.import_module("kernels_pallas.fill_rows")

ON_GPU = jax.default_backend() in ops.GPU_BACKENDS
FMT = "q8g64"
SESSIONS, ROWS_PER_SESSION, LAYERS, PAGE = 16, 1 << 20, 9, 64
TARGET_POOL_ROWS = SESSIONS * ROWS_PER_SESSION * LAYERS  # 150,994,944 (pages x layers x rows per page)


def _mem_available() -> int:
    """Bytes the kernel says can be allocated without swapping (MemAvailable)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _packed_rows(n: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    latent = rng.normal(size=(n, 512)) * 2.0 ** rng.integers(-6, 6, size=(n, 1))
    return {k: np.asarray(v) for k, v in kvf.pack(kvf.get_format(FMT), jnp.asarray(latent, jnp.float32),
                                                  jnp.asarray(rng.normal(size=(n, 64)), jnp.float32)).items()}


# An int8 latent plane of 2**31 + 32,768 elements: its rows from 2**22 on start at byte (and element) 2**31 or later.
ROWS_PAST_2_31 = (1 << 22) + 64


@pytest.mark.skipif(_mem_available() < 8 << 30, reason="needs ~5 GB of host memory (a 2.7 GB pool, copied once)")
def test_hot_gather_reads_host_rows_past_2_31_bytes():
    fmt = kvf.get_format(FMT)
    shapes = fmt.plane_shapes(ROWS_PAST_2_31)
    assert shapes["latent"][0][0] * shapes["latent"][0][1] > 2**31 and shapes["latent"][1] == np.int8
    # Rows around byte offset 2**31 of the latent plane, and the last row; the rest of the plane is zero pages that
    # NumPy never touches (the copy to a JAX array is the only dense one).
    rows = np.array([(1 << 22) - 1, 1 << 22, (1 << 22) + 1, (1 << 22) + 37, ROWS_PAST_2_31 - 1], np.int64)
    assert (rows[1:] * 512 >= 2**31).all()
    written = _packed_rows(len(rows), 0)
    host_np = {n: np.zeros(s, d) for n, (s, d) in shapes.items()}
    for n in host_np:
        host_np[n][rows] = written[n]
    host = {n: jnp.asarray(v) for n, v in host_np.items()}
    del host_np
    ring, hot = _packed_rows(8, 1), _packed_rows(8, 2)
    # 16 entries (4 programs of the launch shape): every row from host memory, some twice, one ring and one hot row
    source = np.full(16, hg.HOST, np.int32)
    row = np.resize(rows, 16).astype(np.int32)
    source[[5, 11]], row[[5, 11]] = [hg.RING, hg.HOT], [3, 6]
    args = (jnp.asarray(source), jnp.asarray(row), {n: jnp.asarray(v) for n, v in ring.items()},
            {n: jnp.asarray(v) for n, v in hot.items()}, host)
    kw = dict(kv_format=FMT, out_dtype=jnp.float32, block_rows=hg.DEFAULT_BLOCK_ROWS)
    got = hg.hot_gather(*args, interpret=True, **kw)
    want = hg.hot_gather_reference(*args, **kw)
    got, want = (x[:2] + (hg.packed_at_misses(x[2], args[0]),) for x in (got, want))  # packed: misses only
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    from_host = source == hg.HOST
    index = {int(r): i for i, r in enumerate(rows)}
    for n in written:
        packed = np.asarray(got[2][n])
        np.testing.assert_array_equal(packed[from_host], written[n][[index[int(r)] for r in row[from_host]]],
                                      err_msg=n)
    lat, rope = kvf.unpack(fmt, {n: jnp.asarray(v) for n, v in written.items()}, jnp.float32)
    np.testing.assert_array_equal(np.asarray(got[0])[from_host], np.asarray(lat)[[index[int(r)] for r in
                                                                                    row[from_host]]])


def _write_then_gather(rows: int, starts: list, block: int = 8):
    """The engine's path: ``allocate_pool`` in pinned_host memory, ``copy_blocks`` writing row blocks at ``starts``
    into it (copyback), the hot gather reading them back (zero-copy on a GPU); the kernels, compiled on a GPU."""
    fmt = kvf.get_format(FMT)
    pool = offload.allocate_pool(fmt, rows, jax.devices()[0])
    assert all(v.sharding.memory_kind == "pinned_host" for v in pool.values())
    starts = np.asarray(starts, np.int32)
    written = _packed_rows(len(starts) * block, 3)
    src = {n: jnp.asarray(v) for n, v in written.items()}
    # Inside jitted functions with the pool's placement as the output's, as the engine's steps run them (an eager
    # call cannot return a kernel's output aliased to pinned_host memory: XLA refuses the output's location).
    write = jax.jit(lambda pool, src: ops.copy_blocks(
        pool, src, jnp.arange(len(starts), dtype=jnp.int32) * block, jnp.asarray(starts),
        jnp.full((len(starts),), block, jnp.int32), block_size=block, impl="pallas"),
        out_shardings={n: v.sharding for n, v in pool.items()}, donate_argnums=0)
    pool = write(pool, src)
    assert all(v.sharding.memory_kind == "pinned_host" for v in pool.values())
    at = (starts[:, None] + np.arange(block)[None, :]).reshape(-1)
    ring = {n: jnp.zeros((8, v.shape[1]), v.dtype) for n, v in src.items()}
    gather = jax.jit(lambda pool: ops.hot_gather(jnp.full((len(at),), hg.HOST, jnp.int32), jnp.asarray(at, jnp.int32),
                                                 ring, ring, pool, kv_format=FMT, out_dtype=jnp.float32,
                                                 impl="pallas"))
    latent, _, packed = gather(pool)
    for n in written:
        np.testing.assert_array_equal(np.asarray(packed[n]), written[n], err_msg=n)
    want_latent, _ = kvf.unpack(fmt, src, jnp.float32)
    np.testing.assert_array_equal(np.asarray(latent), np.asarray(want_latent))
    return pool


def test_kernels_write_and_read_a_pinned_pool():
    _write_then_gather(1024, [0, 500, 1024 - 8])


# A pool past 4 GiB (int8 latent plane of 2**32 + 32,768 bytes): the compiled kernels address it with 64-bit offsets.
ROWS_PAST_2_32 = (1 << 23) + 64


@pytest.mark.skipif(not ON_GPU, reason="the compiled kernels need a GPU")
def test_compiled_kernels_write_and_read_a_pool_past_4_gib():
    """Blocks at the start, around bytes 2**31 and 2**32 of the latent plane, and at the end."""
    pool = _write_then_gather(ROWS_PAST_2_32, [0, 1 << 22, (1 << 23) - 4, ROWS_PAST_2_32 - 8])
    assert pool["latent"].nbytes > 2**32


# ----------------------------------------------------------------------------------------------------------------
# The Triton lowering at the target size, on any machine
# ----------------------------------------------------------------------------------------------------------------
S = jax.ShapeDtypeStruct
HOST = NamedSharding(Mesh(jax.devices()[:1], ("x",)), PartitionSpec(), memory_kind="pinned_host")


def _planes(rows, sharding=None):
    return {n: S(s, d, sharding=sharding) for n, (s, d) in kvf.get_format(FMT).plane_shapes(rows).items()}


@pytest.fixture
def triton_modules(monkeypatch):
    """The Triton modules Pallas builds while lowering (their MLIR text), captured from JAX's lowering function."""
    try:
        from jax._src.pallas.triton import lowering
    except ImportError as e:  # JAX's internals moved: the addressing rule needs checking again by hand
        pytest.skip(f"no Pallas Triton lowering module: {e}")
    modules = []
    lower = lowering.lower_jaxpr_to_triton_module

    def capture(*args, **kwargs):
        result = lower(*args, **kwargs)
        modules.append(result.module.operation.get_asm())
        return result

    monkeypatch.setattr(lowering, "lower_jaxpr_to_triton_module", capture)
    return modules


def _lower_for_cuda(fn, *args):
    export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)


def _offset_types(module: str, pointee: str, width: int) -> list:
    """Offset element types of the ``tt.addptr`` ops on ``[rows, width]`` tensors of pointers to ``pointee``."""
    return re.findall(rf"tt\.addptr [^\n]*: tensor<\d+x{width}x!tt\.ptr<{pointee}>>, tensor<\d+x{width}x(i\d+)>",
                      module)


def test_lowering_addresses_the_target_pool_in_64_bits(triton_modules):
    """At 16 x 1M x 9 rows the pool's latent (77 GB) and rope (19 GB) planes get 64-bit offsets; the ring and hot
    planes and the 2.4 GB scale plane (fewer than 2**31 elements) 32-bit ones, which reach every element."""
    hot_gather = functools.partial(hg.hot_gather, kv_format=FMT, out_dtype=jnp.bfloat16,
                                   block_rows=hg.DEFAULT_BLOCK_ROWS, num_warps=hg.DEFAULT_NUM_WARPS)
    pool = _planes(TARGET_POOL_ROWS, HOST)
    assert pool["latent"].shape[0] * 512 > 7e10
    E = 4 * 2048
    # (a hot cache of 4 slots: 16 slots' int8 latents, 2.4 GB, are what glm53.memory grows past 2**32 bytes)
    _lower_for_cuda(hot_gather, S((E,), jnp.int32), S((E,), jnp.int32), _planes(LAYERS * SESSIONS * 256),
                    _planes(LAYERS * 4 * 32768), pool)
    (module,) = triton_modules
    # a latent and a rope load per source (ring, hot, host) and the stores of the output blocks: only the host
    # pool's loads are 64-bit (the bf16 rope and scale planes are stored as their bits: i16 pointers)
    latent, rope = _offset_types(module, "i8", 512), _offset_types(module, "i16", 64)
    assert len(latent) >= 3 and latent.count("i64") == 1 and set(latent) == {"i32", "i64"}
    assert len(rope) >= 3 and rope.count("i64") == 1 and set(rope) == {"i32", "i64"}
    assert set(_offset_types(module, "i16", 8)) == {"i32"}  # scale: 151M x 8 elements < 2**31

    # the copyback writes the same pool: 64-bit offsets on its side
    triton_modules.clear()
    NB = SESSIONS * LAYERS * 2
    _lower_for_cuda(functools.partial(cb.copy_blocks, block_size=PAGE), pool, _planes(LAYERS * SESSIONS * 256),
                    *(S((NB,), jnp.int32),) * 3)
    (module,) = triton_modules
    assert set(_offset_types(module, "i8", 512)) == {"i32", "i64"}


def test_lowering_of_an_int16_slot_map_at_the_target_size(triton_modules):
    """The fill's bookkeeping on the int16 slot map of 9 layers x 16 slots x 1M positions (151M entries, 302 MB):
    it lowers, storing int16, with 32-bit offsets (every entry below 2**31)."""
    L, H, B, K = LAYERS, 32768, 4, 2048
    maps = dict(pin_round=S((L, SESSIONS, H), jnp.int32), position_of_slot=S((L, SESSIONS, H), jnp.int32),
                slot_of_position=S((L, SESSIONS, ROWS_PER_SESSION), offload.slot_map_dtype(H)),
                rounds=S((L, SESSIONS), jnp.int32), clock=S((L, SESSIONS), jnp.int32),
                counters=S((L, SESSIONS, 5), jnp.int32))
    rnd = dict(pos=S((B, 4 * K), jnp.int32), source=S((B, 4 * K), jnp.int32), slot=S((B, 4 * K), jnp.int32),
               valid=S((B, 4 * K), jnp.bool_))
    fill = functools.partial(frd.fill_round, layers=tuple(range(L)), hot_rows=H, distinct=False, max_repeats=4)
    _lower_for_cuda(fill, maps, (rnd,) * L, S((B,), jnp.int32), S((B,), jnp.bool_))
    (module,) = triton_modules
    assert "!tt.ptr<i16>" in module
    assert not re.search(r"tt\.addptr [^\n]*!tt\.ptr<i16>[^\n]*xi64>", module)


def test_compiled_kernels_refuse_planes_they_cannot_address():
    """A 1-byte plane of 2**31..2**32 elements would get negative 32-bit offsets, and a plane of 2**31 rows int32
    row indices cannot reach: the compiled kernels refuse both (the interpreter and references take the first)."""
    small = _planes(64)
    idx = S((16,), jnp.int32)
    misaddressed = _planes(ROWS_PAST_2_31)
    with pytest.raises(ValueError, match="negative 32-bit offsets"):
        jax.eval_shape(functools.partial(hg.hot_gather, kv_format=FMT, interpret=False), idx, idx, small, small,
                       misaddressed)
    jax.eval_shape(functools.partial(hg.hot_gather, kv_format=FMT, interpret=True), idx, idx, small, small,
                   misaddressed)
    too_many_rows = {n: S((2**31, 1), jnp.int8) for n in ("latent",)}
    with pytest.raises(ValueError, match="row indices are int32"):
        hg.check_addressable(too_many_rows, "host", compiled=False)
    with pytest.raises(ValueError, match="negative 32-bit offsets"):
        jax.eval_shape(functools.partial(cb.copy_blocks, block_size=16), misaddressed, small, idx, idx, idx)
    assert not hg.triton_misaddressed(_planes(ROWS_PAST_2_32)["latent"].shape, jnp.int8)
    assert not hg.triton_misaddressed(_planes(TARGET_POOL_ROWS)["latent"].shape, jnp.int8)


# ----------------------------------------------------------------------------------------------------------------
# Sizes and allocation
# ----------------------------------------------------------------------------------------------------------------
def _h200_config():
    from configs import h200_bench

    c = h200_bench.get_config()
    cfg = glm53.ModelConfig.from_config_dict(c.model)
    cc = glm53.CacheConfig.from_config_dict(c.cache).replace(mode="offload", kv_format=FMT, hot_rows=32768,
                                                             copyback_every=PAGE)
    return cfg, cc


def test_validate_refuses_arrays_past_int32_rows():
    cfg, cc = _h200_config()
    L = cfg.num_cache_layers
    assert L == LAYERS
    pages = SESSIONS * ROWS_PER_SESSION // PAGE
    offload.validate(cfg, cc, SESSIONS, ROWS_PER_SESSION, pages)  # the target: 151M pool rows, 151M map entries
    assert offload.indexed_rows(cfg, cc, SESSIONS, ROWS_PER_SESSION, pages)["host pool"][0] == TARGET_POOL_ROWS
    too_many_pages = -(-2**31 // (L * PAGE))  # the first page count whose pool reaches 2**31 rows
    with pytest.raises(ConfigError, match=rf"host pool would hold {too_many_pages * L * PAGE:,} rows "
                                          rf"\({too_many_pages:,} pages x {L} layers x {PAGE} rows per page\)"):
        offload.validate(cfg, cc, SESSIONS, ROWS_PER_SESSION, too_many_pages)
    offload.validate(cfg, cc, SESSIONS, ROWS_PER_SESSION, too_many_pages - 1)
    with pytest.raises(ConfigError, match=r"slot_of_position would hold 2,415,919,104 rows \(9 layers x 256 slots"):
        offload.validate(cfg, cc, 256, ROWS_PER_SESSION, pages)


def test_slot_map_dtype():
    assert offload.slot_map_dtype(32768) == np.int16  # slots 0..32767 and -1
    assert offload.slot_map_dtype(32769) == np.int32 and offload.slot_map_dtype(65536) == np.int32
    cfg, cc = _h200_config()
    parts = glm53.memory.cache_bytes(cfg, cc, SESSIONS, ROWS_PER_SESSION, 1, jnp.bfloat16)
    assert parts["device"]["slot_of_position"] == LAYERS * SESSIONS * ROWS_PER_SESSION * 2  # 302 MB, not 604
    parts = glm53.memory.cache_bytes(cfg, cc.replace(hot_rows=65536), SESSIONS, ROWS_PER_SESSION, 1, jnp.bfloat16)
    assert parts["device"]["slot_of_position"] == LAYERS * SESSIONS * ROWS_PER_SESSION * 4


def test_allocate_pool_is_zero_pinned_host_with_progress(capsys):
    fmt = kvf.get_format(FMT)
    rows = 3 * PAGE
    pool = offload.allocate_pool(fmt, rows, jax.devices()[0], progress_min_bytes=0)
    assert "host pool" in capsys.readouterr().err
    for n, (shape, dtype) in fmt.plane_shapes(rows).items():
        assert pool[n].shape == shape and pool[n].dtype == dtype
        assert pool[n].sharding.memory_kind == "pinned_host"
        assert not np.asarray(pool[n]).any()
    offload.allocate_pool(fmt, rows, jax.devices()[0])  # small pools: no bar
    assert capsys.readouterr().err == ""


# ----------------------------------------------------------------------------------------------------------------
# The hot cache at the target: padding rows, not phantom slots
# ----------------------------------------------------------------------------------------------------------------
def _traced_pool(fmt, rows, device, **kw):
    """``allocate_pool`` traced: zeros of the pool's shapes (eval_shape allocates nothing)."""
    return {n: jnp.zeros(s, d) for n, (s, d) in fmt.plane_shapes(rows).items()}


def test_hot_cache_at_the_target_gets_padding_rows_not_phantom_slots(monkeypatch):
    """16 sessions x 32,768 hot rows x 9 layers: the hot int8 latent plane (2.4G elements, 2.4 GB) would be
    misaddressed. It alone grows, by rows, just past 2**32 bytes; the 2-byte planes, the ring and every per-slot
    array keep 16 slots (phantom slots made them 29: 42.4 GiB of device cache instead of 25.1)."""
    cfg, cc = _h200_config()
    L, H, N = LAYERS, cc.hot_rows, 1048832  # N: the 16 x 1M run's capacity (experiments/results/sessions_1m_16x.json)
    R = offload.ring_rows_for(cc)
    hot, ring = offload.hot_shapes(cfg, cc, SESSIONS), offload.ring_shapes(cfg, cc, SESSIONS)
    assert hg.triton_misaddressed((L * SESSIONS * H, 512), jnp.int8)  # unpadded: 2**31 <= 2.4G elements <= 2**32
    assert hot["latent"] == ((2**32 // 512 + 1, 512), np.int8)  # the fewest rows past 2**32 bytes
    assert hot["scale"][0] == (L * SESSIONS * H, 8) and hot["rope"][0] == (L * SESSIONS * H, 64)  # never padded
    assert all(s[0] == L * SESSIONS * R for s, _ in ring.values())  # 151M elements: addressable as it is
    assert not any(hg.triton_misaddressed(s, d) for s, d in (*hot.values(), *ring.values()))
    assert glm53.memory.allocated_slots(cfg, cc, SESSIONS, N) == SESSIONS
    parts = glm53.memory.cache_bytes(cfg, cc, SESSIONS, N, 1, jnp.bfloat16)["device"]
    assert parts["hot"] == (2**32 // 512 + 1) * 512 + L * SESSIONS * H * (8 + 64) * 2
    assert parts["index_keys"] == 5 * SESSIONS * N * 128 * 2  # 16 slots of indexer keys, not 29
    assert sum(parts.values()) == 26_989_246_016  # was 45,512,232,628 with 29 slots (the measured 42.4 GiB)

    # The cache init, traced (nothing allocated): every per-slot array has 16 slots, the hot and ring planes the
    # shapes above, and cache_bytes counts exactly what it holds, padding included.
    monkeypatch.setattr(offload, "allocate_pool", _traced_pool)
    small = 4096  # capacity does not enter the hot plane; a small one keeps the traced arrays small
    c = jax.eval_shape(lambda: offload.init_offload(cfg, cc, SESSIONS, small, 1, jnp.bfloat16))
    assert c.num_slots == SESSIONS and c.hot_rows == H and c.ring_rows == R
    for name, a in c.hot.items():
        assert (a.shape, a.dtype) == hot[name]
    for name, a in c.ring.items():
        assert (a.shape, a.dtype) == ring[name]
    assert c.page_table.shape[0] == c.position_of_slot.shape[1] == c.bulk_pages.shape[1] == SESSIONS
    held: dict = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(c):
        part = str(getattr(path[0], "name", path[0]))
        held[part] = held.get(part, 0) + int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
    parts = glm53.memory.cache_bytes(cfg, cc, SESSIONS, small, 1, jnp.bfloat16)
    assert held.pop("pool") == parts["host"]["pool"]
    assert held == parts["device"]


def test_lowering_of_the_padded_hot_cache_at_the_target(triton_modules):
    """The padded hot planes at the target, as the kernels get them: the int8 latent plane (just past 2**32
    bytes) is addressed in 64 bits by the gather and the fill, its 2-byte planes (fewer than 2**31 elements) in 32;
    unpadded, the compiled kernels refuse it."""
    cfg, cc = _h200_config()
    hot = {n: S(s, d) for n, (s, d) in offload.hot_shapes(cfg, cc, SESSIONS).items()}
    ring = {n: S(s, d) for n, (s, d) in offload.ring_shapes(cfg, cc, SESSIONS).items()}
    pool = _planes(TARGET_POOL_ROWS, HOST)
    E = 4 * 2048
    hot_gather = functools.partial(hg.hot_gather, kv_format=FMT, out_dtype=jnp.bfloat16,
                                   block_rows=hg.DEFAULT_BLOCK_ROWS, num_warps=hg.DEFAULT_NUM_WARPS)
    _lower_for_cuda(hot_gather, S((E,), jnp.int32), S((E,), jnp.int32), ring, hot, pool)
    (module,) = triton_modules
    latent, rope = _offset_types(module, "i8", 512), _offset_types(module, "i16", 64)
    # ring: 32-bit; hot and host: 64-bit (rope: the host pool's only)
    assert latent.count("i64") == 2 and "i32" in latent
    assert rope.count("i64") == 1 and "i32" in rope
    assert set(_offset_types(module, "i16", 8)) == {"i32"}

    triton_modules.clear()
    B, F = 4, 4 * 2048
    fill = functools.partial(fr.fill_rows, layers=tuple(range(LAYERS)), sessions=SESSIONS, hot_rows=cc.hot_rows,
                             block_rows=16)
    rows = tuple({n: S((B * F, v.shape[1]), v.dtype) for n, v in hot.items()} for _ in range(LAYERS))
    _lower_for_cuda(fill, hot, rows, *(S((LAYERS, B, F), jnp.int32),) * 2, S((LAYERS, B), jnp.int32),
                    S((B,), jnp.int32))
    (module,) = triton_modules
    assert "i64" in _offset_types(module, "i8", 512)  # the stores into the padded latent plane
    assert set(_offset_types(module, "i16", 64)) == {"i32"}

    unpadded = {n: S((LAYERS * SESSIONS * cc.hot_rows, v.shape[1]), v.dtype) for n, v in hot.items()}
    with pytest.raises(ValueError, match="negative 32-bit offsets"):
        jax.eval_shape(hot_gather, S((E,), jnp.int32), S((E,), jnp.int32), ring, unpadded, pool)
