"""A batch-1 decode step keeps its wide small projections GEMMs (``glm53.model.matmul``).

XLA's GPU simplifier rewrites a dot with a one-row side whose operands hold fewer than 10M elements into a multiply
and a reduce, which ran the indexer's ``wq_b`` at a quarter of the bandwidth on the H200; the model pads the one
token to two for dots at least ``_TWO_ROW_MIN_WIDTH`` wide so they stay GEMMs (narrower ones ran faster reduced).
The step is lowered at GLM-5's widths (``configs/h200_bench.py``, abstract weights: nothing is allocated) and every
dot of it with a one-row side, a wide other side and operands under the threshold must be one left so on purpose.
"""

import re

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from configs import h200_bench
from glm53 import memory, model as model_lib
from glm53.config import CacheConfig, ModelConfig

_DOT = re.compile(r"stablehlo\.dot_general %\S+, %\S+,(?: batching_dims = \[([\d, ]*)\] x \[([\d, ]*)\],)? "
                  r"contracting_dims = \[([\d, ]*)\] x \[([\d, ]*)\][^:]*: \(tensor<([^>]*)>, tensor<([^>]*)>\)"
                  r".*loc\((#loc\d+)\)")
# the routed experts' outputs weighted by the token's 8 routing weights (a weighted sum by nature), and the CPU
# reference of the indexer's scores, one head at a time (a GPU step runs kernels_pallas' indexer_scores instead)
_LEFT_ONE_ROW = ("nkh,nk->nh", "std,snd->stn")


def _vector_dots(text: str) -> list[str]:
    locs = dict(re.findall(r'^(#loc\d+) = loc\("([^"]*)"', text, re.M))

    def dims(s):
        return [int(v) for v in s.split("x")[:-1]]

    def axes(s):
        return [int(v) for v in s.split(",") if v.strip()] if s else []

    found = []
    for m in _DOT.finditer(text):
        lb, rb, lc, rc = (axes(g) for g in m.group(1, 2, 3, 4))
        ls, rs = dims(m.group(5)), dims(m.group(6))
        lhs_rows = np.prod([d for i, d in enumerate(ls) if i not in lb + lc])
        rhs_cols = np.prod([d for i, d in enumerate(rs) if i not in rb + rc])
        other_width = rhs_cols if lhs_rows == 1 else lhs_rows if rhs_cols == 1 else 0
        if (other_width >= model_lib._TWO_ROW_MIN_WIDTH
                and np.prod(ls) + np.prod(rs) < model_lib._XLA_DOT_TO_REDUCE_MAX_ELEMENTS):
            found.append(f"{locs.get(m.group(7), m.group(7))}: {m.group(5)} x {m.group(6)}")
    return found


@pytest.mark.parametrize("mode", ["resident", "offload"])
def test_batch1_decode_has_no_small_vector_dots(mode):
    c = h200_bench.get_config()
    cc = CacheConfig.from_config_dict(c.cache).replace(mode=mode)
    lowered, _ = memory.lower_step(ModelConfig.from_config_dict(c.model), cc, sessions=1, history=4096,
                                   dtype="bfloat16")
    text = lowered.as_text(debug_info=True)
    assert text.count("stablehlo.dot_general") > 50  # the parse below sees the step's dots
    assert len(_DOT.findall(text)) == text.count("stablehlo.dot_general")
    assert "(tensor<2x2048xbf16>, tensor<2048x4096xbf16>)" in text, "the indexer's wq_b, padded"
    left = [d for d in _vector_dots(text) if not any(f"{n}/dot_general" in d for n in _LEFT_ONE_ROW)]
    assert left == [], left


def test_padding_keeps_the_values():
    rng = np.random.default_rng(0)
    wide = model_lib._TWO_ROW_MIN_WIDTH
    for n in (48, wide):
        w = jnp.asarray(rng.standard_normal((64, n)), jnp.float32)
        for shape in [(1, 1, 64), (64,), (1, 64), (3, 2, 64)]:
            x = jnp.asarray(rng.standard_normal(shape), jnp.float32)
            y = model_lib.matmul(x, w)
            assert y.shape == shape[:-1] + (n,)
            np.testing.assert_allclose(y, jnp.dot(x, w, precision="highest"), rtol=1e-5, atol=1e-5)
        text = jax.jit(model_lib.matmul).lower(jnp.zeros((1, 1, 64)), w).as_text()
        assert ("tensor<2x64xf32>" in text) == (n >= wide), "one row is padded to two when the dot is wide"
