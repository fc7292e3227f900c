"""Profile the decode step with ``glm53.model.matmul`` swapped for a variant: the padding's A/B by kernel.

``matvec_rows.py`` times the variants end to end, where this host's pace moves tok/s by ~1%; the profile's device
time and its ops (``us_per_step_by_op``; ``python -m experiments.compare_profiles A.json B.json``) show what each
variant's kernels cost. Variants:
- ``model``: the model as it is (a zero row under the token for dots at least ``_TWO_ROW_MIN_WIDTH`` wide);
- ``repeated_row``: the token's row twice instead of a zero row (a broadcast, which XLA may fuse into the GEMM
  instead of running the pad kernel it runs for the zero row: 19 more kernels a step at d9ae3a9);
- ``from_512``: the model with the width lowered to 512 (``kv_a_proj_with_mqa`` padded too);
- ``plain``: every one-row dot plain (XLA strength-reduces the small ones).

    JAX_PLATFORMS=cuda,cpu python experiments/results/probes/profile_variant.py VARIANT [profile_decode flags]

The report's ``command`` names ``experiments.profile_decode`` with the flags; the variant is in ``probe_variant``.
"""
import json
import sys

import jax.numpy as jnp
from absl import app

from experiments import profile_decode
from glm53 import model as model_lib

variant = sys.argv[1]


def repeated_row(x, w):
    if not model_lib.pads_to_two_rows(x, w):
        return jnp.dot(x, w)
    y = jnp.dot(jnp.broadcast_to(x.reshape(1, x.shape[-1]), (2, x.shape[-1])), w)
    return y[:1].reshape(*x.shape[:-1], w.shape[-1])


if variant == "repeated_row":
    model_lib.matmul = repeated_row
elif variant == "from_512":
    model_lib._TWO_ROW_MIN_WIDTH = 512
elif variant == "plain":
    model_lib.matmul = lambda x, w: jnp.dot(x, w)
elif variant != "model":
    raise SystemExit(f"unknown variant {variant!r}: model, repeated_row, from_512 or plain")


def main(argv):
    profile_decode.main(argv)
    out = profile_decode.FLAGS.out
    report = json.load(open(out))
    report["probe_variant"] = variant
    json.dump(report, open(out, "w"), indent=1)


if __name__ == "__main__":
    sys.argv = [sys.argv[0]] + sys.argv[2:]
    app.run(main)
