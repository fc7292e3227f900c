"""The sparse MLA decode-attention kernel (``kernels_pallas.mla_decode``, interpreted on the CPU) against its jnp
reference, which is the model's einsum attention."""

import importlib

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest

mla = importlib.import_module("kernels_pallas.mla_decode")
INTERPRET = jax.default_backend() not in ("gpu", "cuda", "rocm")


def _case(seed, Q=3, h=16, C=64, R=16, K=128, dtype=jnp.float32, attend_fraction=0.7):
    rng = np.random.default_rng(seed)
    q_lat, q_rope = rng.normal(size=(Q, h, C)), rng.normal(size=(Q, h, R))
    lat, rope = rng.normal(size=(Q, K, C)), rng.normal(size=(Q, K, R))
    attend = rng.random((Q, K)) < attend_fraction
    attend[:, 0] = True  # every row attends to something (a row with nothing is its own test)
    return tuple(jnp.asarray(x, dtype) for x in (q_lat, q_rope, lat, rope)) + (jnp.asarray(attend),)


@pytest.mark.parametrize("dtype,splits,head_block,column_parts,tol", [
    (jnp.float32, 1, None, 2, 1e-5), (jnp.float32, 4, None, 2, 1e-5), (jnp.float32, 2, 16, 1, 1e-5),
    (jnp.float32, 2, 16, 4, 1e-5), (jnp.bfloat16, 2, None, 2, 3e-2), (jnp.bfloat16, None, 16, 2, 3e-2)])
def test_mla_decode_matches_reference(dtype, splits, head_block, column_parts, tol):
    """Splits of the rows, blocks of heads, slices of the columns and the online softmax give the reference's
    result: to f32 rounding in f32, to the rounding of bf16 probabilities in bf16 (the kernel rounds them before
    normalising)."""
    args = _case(0, h=32, dtype=dtype)
    kw = dict(softmax_scale=0.125, splits=splits, block_rows=16, head_block=head_block, column_parts=column_parts)
    got = mla.mla_decode(*args, interpret=INTERPRET, **kw)
    want = mla.mla_decode_reference(*args, **kw)
    assert got.dtype == want.dtype == dtype and got.shape == want.shape == (3, 32, 64)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)


def test_mla_decode_masks_and_an_empty_row():
    """Rows not attended to count for nothing, even when their scores would dominate (a split entirely masked
    included); a query row attending to nothing is NaN in both."""
    q_lat, q_rope, lat, rope, attend = _case(1, attend_fraction=0.5)
    attend = np.asarray(attend).copy()
    attend[1, 32:64] = False  # a whole split of row 1 (4 splits of 32 rows)
    attend[2] = False
    lat = lat.at[:, ~np.asarray(attend).any(0)].set(1e3)  # masked rows with huge values
    kw = dict(softmax_scale=0.125, splits=4, block_rows=16)
    got = np.asarray(mla.mla_decode(q_lat, q_rope, lat, rope, jnp.asarray(attend), interpret=INTERPRET, **kw))
    want = np.asarray(mla.mla_decode_reference(q_lat, q_rope, lat, rope, jnp.asarray(attend), **kw))
    assert np.isnan(got[2]).all() and np.isnan(want[2]).all()
    np.testing.assert_allclose(got[:2], want[:2], rtol=1e-5, atol=1e-5)
    # only the attended rows matter: changing the others changes nothing
    lat2 = jnp.where(jnp.asarray(attend)[..., None], lat, -7.0)
    again = np.asarray(mla.mla_decode(q_lat, q_rope, lat2, rope, jnp.asarray(attend), interpret=INTERPRET, **kw))
    np.testing.assert_array_equal(again[:2], got[:2])


def test_mla_decode_rejects_what_it_cannot_run():
    args = _case(2)
    with pytest.raises(ValueError, match="do not agree"):
        mla.mla_decode(args[0], args[1], args[2][:, :64], *args[3:], softmax_scale=1.0, interpret=INTERPRET)
    with pytest.raises(ValueError, match="power-of-two head_block"):
        mla.mla_decode(*_case(2, h=12), softmax_scale=1.0, interpret=INTERPRET)
    with pytest.raises(ValueError, match="dividing heads 16"):
        mla.mla_decode(*args, softmax_scale=1.0, head_block=32, interpret=INTERPRET)
    with pytest.raises(ValueError, match="splits"):
        mla.mla_decode(*args, softmax_scale=1.0, splits=3, block_rows=16, interpret=INTERPRET)


def test_default_splits():
    assert mla.default_splits(1, 2048, 32) == 64  # batch 1: as many as the row blocks allow up to ~256 programs
    assert mla.default_splits(10, 2048, 32) == 8
    assert mla.default_splits(40, 2048, 32) == 2
    assert mla.default_splits(512, 2048, 32) == 1
    assert mla.default_splits(1, 64, 32) == 2
    assert mla.default_splits(10, 2048, 32, parts=8) == 2  # 4 head blocks x 2 column parts


def _model_case(seed, B=2, T=2, h=16, C=64, R=16, K=32, dtype=jnp.float32):
    q_lat, q_rope, lat, rope, attend = _case(seed, Q=B * T, h=h, C=C, R=R, K=K, dtype=dtype)
    return (q_lat.reshape(B, T, h, C), q_rope.reshape(B, T, h, R), lat.reshape(B, T, K, C),
            rope.reshape(B, T, K, R), attend.reshape(B, T, K))


def test_ops_mla_attention_runs_the_kernel_where_it_can():
    """``ops.mla_attention`` (the model's call): the kernel on decode and verify shapes, to the reference's
    rounding; the reference itself, bit for bit, where the kernel does not apply (a prefill chunk's many rows, heads
    or top-k it cannot take) or is not asked for. The reference takes the model's ``[B, T]`` batch as it is."""
    from kernels_pallas import ops

    args = _model_case(3)
    want = mla.mla_decode_reference(*args, softmax_scale=0.125)
    per_row = mla.mla_decode_reference(*(a.reshape((4,) + a.shape[2:]) for a in args), softmax_scale=0.125)
    np.testing.assert_array_equal(np.asarray(want).reshape(per_row.shape), per_row)
    got = ops.mla_attention(*args, softmax_scale=0.125, impl="pallas")
    assert got.shape == want.shape == (2, 2, 16, 64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert not np.array_equal(got, want)  # the kernel ran: its online softmax sums in another order
    np.testing.assert_array_equal(ops.mla_attention(*args, softmax_scale=0.125, impl="reference"), want)
    for case in (_model_case(4, T=ops.MLA_DECODE_MAX_ROWS + 1), _model_case(5, h=8), _model_case(6, K=24)):
        np.testing.assert_array_equal(ops.mla_attention(*case, softmax_scale=0.125, impl="pallas"),
                                      mla.mla_decode_reference(*case, softmax_scale=0.125))


@pytest.mark.devices(2)
def test_ops_mla_attention_splits_heads_over_tp():
    """On a tp mesh each device runs the kernel on its own heads (the queries sharded over heads, the gathered
    rows replicated): the result equals one device's to float rounding and stays sharded over heads."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from kernels_pallas import ops

    mesh = jax.make_mesh((1, 2), ("stage", "tp"), devices=jax.devices()[:2])
    args = _model_case(7, h=32)
    heads, rep = NamedSharding(mesh, P(None, None, "tp", None)), NamedSharding(mesh, P())
    placed = [jax.device_put(a, heads if i < 2 else rep) for i, a in enumerate(args)]
    one = ops.mla_attention(*args, softmax_scale=0.125, impl="pallas")
    split = jax.jit(lambda *a: ops.mla_attention(*a, softmax_scale=0.125, impl="pallas", mesh=mesh))(*placed)
    assert split.sharding.is_equivalent_to(heads, 4)
    np.testing.assert_allclose(split, one, rtol=1e-5, atol=1e-5)
    # What GSPMD cannot show on the CPU (the interpreted kernel is plain HLO it partitions; a compiled one is a
    # custom call it would replicate): the kernel itself is handed each device's 16 heads.
    jaxpr = jax.make_jaxpr(lambda *a: ops.mla_attention(*a, softmax_scale=0.125, impl="pallas", mesh=mesh))(*placed)
    assert _pallas_query_shapes(jaxpr.jaxpr) == [(4, 16, 64)]


def _pallas_query_shapes(jaxpr) -> list:
    """The first operand's shape of every ``pallas_call`` in ``jaxpr``, nested jaxprs included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            found.append(tuple(eqn.invars[0].aval.shape))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += _pallas_query_shapes(sub)
    return found


def test_model_with_the_kernel_offload_equals_resident():
    """The kernel inside the whole model (heads and top-k it takes; interpreted): offload decode with MTP verify
    rounds gives resident's tokens and logits bit for bit, and both stay within float rounding of the einsum
    attention."""
    import dataclasses

    import glm53
    from engine_common import CC, CFG

    cfg = dataclasses.replace(CFG, num_attention_heads=16, index_topk=16)
    model = glm53.from_config(cfg, seed=1, dtype="float32")
    prompts = [np.random.default_rng(s).integers(0, cfg.vocab_size, n).tolist() for s, n in ((0, 150), (1, 90))]
    run = {(mode, k): glm53.generate(model, prompts, max_new_tokens=12, mtp=2, cache=CC.replace(mode=mode),
                                     return_logits=True, kernels=k)
           for mode, k in (("resident", "pallas"), ("offload", "pallas"), ("resident", "reference"))}
    res, off, ref = run["resident", "pallas"], run["offload", "pallas"], run["resident", "reference"]
    assert off.tokens == res.tokens and np.array_equal(off.logits, res.logits)
    assert off.cache_stats["misses"] > 0
    assert res.tokens == ref.tokens
    np.testing.assert_allclose(res.logits, ref.logits, rtol=1e-4, atol=1e-4)
    assert not np.array_equal(res.logits, ref.logits)  # the kernel really ran in the model
