"""Sampling and speculative acceptance as pure functions: greedy ties, the nucleus, and the speculative rule's
guarantee that emitted tokens are distributed as the main model's."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from glm53 import sampling


def test_greedy_is_the_first_argmax():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((4, 300)).astype(np.float32)
    logits[1, [7, 100, 250]] = 9.0  # a tie: the first index wins
    logits[2] = 0.0  # all tied
    out = jax.jit(sampling.sample, static_argnames="greedy")(logits, jnp.int32(0), jnp.arange(4), 0.0, 0.9,
                                                             greedy=True)
    assert out.tolist()[1:3] == [7, 0]
    assert out.tolist() == np.argmax(logits, -1).tolist()


def _primitives(jaxpr) -> set:
    from jax._src import core
    out = set()
    for eqn in jaxpr.eqns:
        out.add(eqn.primitive.name)
        for sub in core.jaxprs_in_params(eqn.params):
            out |= _primitives(sub)
    return out


def test_greedy_sampling_traces_no_keys():
    """A greedy step never makes the keys it would not read: their threefry hashes cost ~60 ms of a decode program's
    lowering, dropped by XLA only after that. Sampling makes them from the seed and the positions."""
    args = (jnp.zeros((3, 50)), jnp.int32(5), jnp.asarray([10, 11, 12]), 1.0, 1.0)
    random_ops = {"random_seed", "random_wrap", "random_fold_in", "random_bits", "threefry2x32"}
    greedy = _primitives(jax.make_jaxpr(functools.partial(sampling.sample, greedy=True))(*args).jaxpr)
    drawn = _primitives(jax.make_jaxpr(functools.partial(sampling.sample, greedy=False))(*args).jaxpr)
    assert not greedy & random_ops, greedy & random_ops
    assert {"random_fold_in", "random_bits"} <= drawn


def test_nucleus_and_temperature():
    logits = jnp.asarray([[2.0, 1.0, 0.5, -1.0]])
    p = sampling.distribution(logits, 1.0, 1e-6)
    assert p.tolist() == [[1.0, 0.0, 0.0, 0.0]]  # a tiny nucleus is greedy
    full = sampling.distribution(logits, 1.0, 1.0)
    np.testing.assert_allclose(full, jax.nn.softmax(logits), rtol=1e-6)
    cut = sampling.distribution(logits, 1.0, 0.8)  # smallest prefix with mass >= 0.8: the first two
    assert (cut[0, 2:] == 0).all() and abs(float(cut.sum()) - 1) < 1e-6
    hot = sampling.distribution(logits, 100.0, 1.0)
    assert float(hot.max() - hot.min()) < 0.02


def test_draws_depend_on_seed_and_position_only():
    logits = jnp.zeros((3, 50))
    a = sampling.sample(logits, jnp.int32(5), jnp.asarray([10, 11, 12]), 1.0, 1.0, greedy=False)
    b = sampling.sample(logits[:1], jnp.int32(5), jnp.asarray([10]), 1.0, 1.0, greedy=False)
    assert int(a[0]) == int(b[0])  # lane 0 alone draws what it draws in a batch
    c = sampling.sample(logits, jnp.int32(6), jnp.asarray([10, 11, 12]), 1.0, 1.0, greedy=False)
    assert a.tolist() != c.tolist()


def test_greedy_acceptance_emits_what_plain_greedy_would():
    logits = np.full((1, 4, 10), -5.0, np.float32)
    target = [3, 1, 4, 1]
    for j, t in enumerate(target):
        logits[0, j, t] = 5.0
    for drafts, want_a in (([3, 1, 4], 3), ([3, 9, 4], 1), ([0, 1, 4], 0)):
        a, tok = sampling.accept_greedy(jnp.asarray(logits), jnp.asarray([drafts], jnp.int32))
        assert int(a[0]) == want_a
        emitted = drafts[:want_a] + [int(tok[0, want_a])]
        assert emitted == target[: want_a + 1]


def test_speculative_sampling_preserves_the_target_distribution():
    """Over many seeds, the first emitted token of a round (accepted draft or resampled) is distributed as p_0, and
    the second (given the first was accepted) as p_1: the rule is exact, whatever the draft distribution q."""
    V, n = 4, 20000
    p_logits = jnp.log(jnp.asarray([[0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1]]))  # rows 0, 1 (D = 1)
    q = jnp.asarray([[0.7, 0.1, 0.1, 0.1]])  # a bad draft distribution

    @jax.jit
    def one(seed):
        d = sampling.draw(q, sampling.position_keys(seed, jnp.asarray([100]), sampling.DRAFT))
        a, tok = sampling.accept_sampled(p_logits[None], d[:, None], q[None], jnp.asarray([100]), seed, 1.0, 1.0)
        return a[0], tok[0]

    a, tok = jax.vmap(one)(jnp.arange(n, dtype=jnp.int32))
    first = np.bincount(np.asarray(tok[:, 0]), minlength=V) / n
    np.testing.assert_allclose(first, [0.1, 0.2, 0.3, 0.4], atol=0.015)
    acc = np.asarray(a) == 1
    second = np.bincount(np.asarray(tok[acc, 1]), minlength=V) / acc.sum()
    np.testing.assert_allclose(second, [0.4, 0.3, 0.2, 0.1], atol=0.03)
    # acceptance rate = sum_x min(p, q) = 0.1 + 0.1 + 0.1 + 0.1
    assert abs(acc.mean() - 0.4) < 0.015
