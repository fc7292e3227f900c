"""Making weights: random ones (glm53.params) with a small leaf drawn whole, as it always was, and a large one block
by block, so drawing a benchmark model holds one block's temporaries, not a whole leaf's (~9x its bytes on the CPU);
and a checkpoint's tensor made the model's (glm53.checkpoint._arranged) holding nothing beside it as read and as
kept, as the memory check counts."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.traverse_util import flatten_dict

import glm53
from glm53 import memory
from glm53 import params as params_lib
from engine_common import MESH_CFG as CFG


def _oracle(key, index, scale, shape, dtype, block=None):
    # jitted as the draws are: XLA fuses the scaling into the normal's arithmetic (eagerly, the last bit differs)
    @jax.jit
    def draw(key):
        k = jax.random.fold_in(key, index)
        if block is not None:
            k = jax.random.fold_in(k, block)
        return (scale * jax.random.normal(k, shape, jnp.float32)).astype(dtype)

    return np.asarray(draw(key))


def test_small_leaves_are_drawn_whole_from_their_index():
    """Leaf i of the sorted paths: scale * normal(fold_in(key(seed), i)) in the model's dtype, norm scales ones,
    biases zeros: the values every model below a block's size had before large leaves were drawn by blocks (every
    third drawn leaf compared: one oracle program per leaf shape)."""
    model = glm53.from_config(CFG, seed=3, dtype="bfloat16")
    flat = flatten_dict(model.params)
    scale = np.float32(CFG.initializer_range)
    assert max(int(np.prod(x.shape)) for x in flat.values()) <= params_lib.DRAW_BLOCK_ELEMENTS
    drawn = []
    for i, path in enumerate(sorted(flat)):
        got = np.asarray(flat[path])
        if path[-1] in ("weight", "k_norm_weight"):
            assert (got == 1).all(), path
        elif path[-1] in ("k_norm_bias", "e_score_correction_bias"):
            assert (got == 0).all(), path
        else:
            drawn.append((i, path, got))
    assert len(drawn) > 30 and len({got.tobytes() for *_, got in drawn}) == len(drawn)
    for i, path, got in drawn[::3]:
        want = _oracle(jax.random.key(3), i, scale, flat[path].shape, flat[path].dtype)
        assert got.tobytes() == want.tobytes(), path


@pytest.mark.parametrize("shape,dtype,blocks", [
    ((37, 50), jnp.float32, [20, 17]),  # rows of 50: 20 a block, the last one shorter
    ((3, 7, 60), jnp.bfloat16, [2, 1]),  # rows of 7 x 60 = 420 elements: 2 a block
    ((2500,), jnp.float32, [1000, 1000, 500]),  # a vector: rows of one element
    ((4, 2000), jnp.bfloat16, [1000] * 8),  # rows longer than a block: the view's rows are single elements
])
def test_a_large_leaf_is_drawn_block_by_block(monkeypatch, shape, dtype, blocks):
    """Over DRAW_BLOCK_ELEMENTS elements: the leaf as rows (its leading axes) of at most a block each, block b of
    them from fold_in(fold_in(key, index), b), written in place; the progress callback gets every byte once."""
    monkeypatch.setattr(params_lib, "DRAW_BLOCK_ELEMENTS", 1000)
    key, scale = jax.random.key(7), np.float32(0.5)
    counted = []
    got = params_lib.normal_leaf(key, 5, scale, shape, dtype, on_block=counted.append)
    assert got.shape == shape and got.dtype == dtype
    n = int(np.prod(shape))
    row = n // sum(blocks)
    flat, start = np.asarray(got).reshape(-1, row), 0
    for b, m in enumerate(blocks):
        want = _oracle(key, 5, scale, (m, row), dtype, block=b)
        assert flat[start:start + m].tobytes() == want.tobytes(), b
        start += m
    assert start == flat.shape[0]
    assert counted == [m * row * np.dtype(dtype).itemsize for m in blocks]
    starts, m = np.cumsum([0] + blocks[:-1]), min(blocks)
    assert len({flat[a:a + m].tobytes() for a in starts}) == len(blocks)  # no block repeats another's values
    # a leaf of exactly a block is drawn whole
    whole = params_lib.normal_leaf(key, 5, scale, (10, 100), dtype)
    assert np.asarray(whole).tobytes() == _oracle(key, 5, scale, (10, 100), dtype).tobytes()


def _host_peak(run):
    """``(run()'s result, the host's peak RSS while it ran over the RSS before it)``, on the CPU backend."""
    if not sys.platform.startswith("linux"):
        pytest.skip("reads the peak RSS from /proc")
    if jax.default_backend() != "cpu":
        pytest.skip("the CPU's memory is the host's; an accelerator's is counted by the memory check's tests")

    def status(field):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))

    with open("/proc/self/clear_refs", "w") as f:  # the peak RSS from now on (Linux 4.0+)
        f.write("5")
    before = status("VmRSS")
    out = jax.block_until_ready(run())
    return out, status("VmHWM") - before


def test_drawing_a_large_leaf_holds_one_blocks_temporaries(monkeypatch):
    """The host's peak memory while a 2^25-element bfloat16 leaf (64 MiB) is drawn on the CPU in blocks of 2^22
    elements: the leaf and at most twice the block's counted temporaries (draw_transient_bytes). Drawn whole, the
    leaf's temporaries were ~9x its bytes, ~0.56 GiB."""
    monkeypatch.setattr(params_lib, "DRAW_BLOCK_ELEMENTS", 1 << 22)
    shape = (1 << 13, 1 << 12)
    key, scale = jax.random.key(0), np.float32(0.02)
    params_lib.normal_leaf(key, 1, scale, (2 << 10, 1 << 12), jnp.bfloat16).block_until_ready()  # compiles a block
    leaf, peak = _host_peak(lambda: params_lib.normal_leaf(key, 1, scale, shape, jnp.bfloat16))
    transient = params_lib.draw_transient_bytes([jax.ShapeDtypeStruct(shape, jnp.bfloat16)])
    assert transient == params_lib.DRAW_BYTES_PER_ELEMENT["cpu"] << 22
    assert peak < leaf.nbytes + 2 * transient, (peak, leaf.nbytes, transient)


@pytest.mark.parametrize("transpose", [False, True])
def test_a_checkpoint_tensor_is_made_the_models_holding_nothing_else(transpose):
    """A 2^25-element bfloat16 tensor as read (64 MiB), made the model's with its finiteness per kept row: the
    host's peak is the kept copy and 8 MiB. ``isfinite(x).all()`` held a bool array of the tensor's size (half its
    bytes), and the max reduction that replaced it a float32 copy (twice) where it read the swapped tensor."""
    from glm53 import checkpoint

    x = jax.device_put(np.ones((1 << 13, 1 << 12), jnp.bfloat16))
    arrange = lambda x: checkpoint._arranged(x, None, transpose=transpose, dequantise_to=None, dtype=jnp.bfloat16)
    jax.block_until_ready(arrange(x))  # compiled
    (kept, finite), peak = _host_peak(lambda: arrange(x))
    assert peak < kept.nbytes + (8 << 20), (peak, kept.nbytes)
    assert finite.shape == (kept.shape[0],) and bool(finite.all())


def test_the_memory_check_counts_a_draws_block():
    """Random weights need their bytes and one block's temporaries (the largest leaf's, below a block) on the
    device they are drawn on, as measured for its platform (none on a GPU); read weights do not draw."""
    dev = jax.local_devices()[0]
    shapes = jax.tree_util.tree_leaves(params_lib.param_shapes(CFG, "float32"))
    largest = max(int(np.prod(x.shape)) for x in shapes)
    (_, read), = memory.weights_need(CFG, "float32", "model", dev)
    (_, drawn), = memory.weights_need(CFG, "float32", "model", dev, drawn=True)
    per = params_lib.DRAW_BYTES_PER_ELEMENT[dev.platform]
    assert drawn - read == per * largest == params_lib.draw_transient_bytes(shapes, dev.platform)
    assert params_lib.draw_transient_bytes(shapes, "gpu") == 0 < params_lib.draw_transient_bytes(shapes, "tpu")


@pytest.mark.parametrize("shape", [(96, 64), (3, 64, 40)])
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_checkpoint_tensors_non_finite_rows_are_found_wherever_they_are(shape, transpose, dtype):
    """A NaN, an inf or a -inf at random places of a tensor as read: exactly the kept rows (experts of a stack)
    holding one are reported, in the model's dtype. A max |x| < inf check missed the NaN in 30 of 100 such tensors
    on the CPU (its vectorised max does not propagate NaN)."""
    from glm53 import checkpoint

    rng = np.random.default_rng(sum(shape) + 2 * transpose)
    arrange = jax.jit(lambda x: checkpoint._arranged(x, None, transpose=transpose, dequantise_to=None,
                                                     dtype=dtype))
    for trial in range(12):
        x = rng.standard_normal(shape).astype(np.float32)
        where = tuple(rng.integers(0, n, size=1 + trial % 3) for n in shape)
        x[where] = [np.nan, np.inf, -np.inf][trial % 3]
        kept, finite = arrange(x)
        want = np.isfinite(np.asarray(kept, np.float32)).reshape(kept.shape[0], -1).all(axis=1)
        assert not want.all() and np.array_equal(np.asarray(finite), want), (trial, where)


def test_a_float32_value_is_finite_in_bfloat16_up_to_where_it_rounds_to_inf():
    """A float32 checkpoint into a bfloat16 model: bfloat16's largest value and everything that rounds to it is
    kept, and from half an ulp past it (2^128 - 2^119, which rounds to inf) the row is refused."""
    from glm53 import checkpoint

    edge = np.float32(2.0 ** 128 - 2.0 ** 119)
    for v, finite in [(edge, False), (np.nextafter(edge, np.float32(0)), True), (-edge, False),
                      (np.float32(jnp.finfo(jnp.bfloat16).max), True), (np.float32(3.4e38), False),
                      (np.float32(np.inf), False), (np.float32(np.nan), False), (np.float32(-1e-45), True)]:
        x = np.ones((3, 4), np.float32)
        x[1, 2] = v
        kept, rows = checkpoint._arranged(x, None, transpose=False, dequantise_to=None, dtype=jnp.bfloat16)
        assert np.array_equal(np.asarray(rows), [True, finite, True]), v
        assert np.isfinite(np.asarray(kept, np.float32)[1]).all() == finite, v
