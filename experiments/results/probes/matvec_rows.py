"""Probe for the next H200 call: does batch-1 decode get faster when its small projections are not strength-reduced?

XLA's GPU algebraic simplifier rewrites a dot into a multiply and a reduce when one side is a vector and the two
operand matrices hold fewer than 10M elements together (``ShouldStrengthReduceDotToReduce``,
``IsMatrixMultiplicationTooSmallForRewriting``). At batch 1 every ``Linear`` of the model sees one row (its size-1
dimensions are stripped), so the indexer's ``wq_b`` (2048 x 4096, 8.4M) became a bf16 multiply fusion writing the
whole product plus a reduce fusion reading it back: ~21 us a layer for 16.8 MB of weights
(``cmdbuf_split_40ed69c.json``, ``profile_decode_8k_model_d2060e0.json``); ``kv_a_proj_with_mqa`` (6144 x 576) and
``wk`` are reduced too. This jaxlib has no compile option to turn that off.

A dot whose lhs has two rows is no vector, so XLA keeps it a GEMM. The probe's runs so far:
- 9ad9454 (``matvec_rows_8k_9ad9454.json``): every small ``Linear`` padded against the plain model;
- 26d9ee4: the model padded its Linears, the indexer's ``weights_proj``, the router and the absorbed head einsums;
  runs: that, the einsums plain, everything plain;
- d9ae3a9: the same without the einsums; runs: that, a repeated row instead of a zero row, everything plain.
Their profiles (``profile_decode_8k_model_{26d9ee4,d9ae3a9}.json``) showed the narrow dots losing by it, so the model
now pads only dots at least ``glm53.model._TWO_ROW_MIN_WIDTH`` wide (the indexer's ``wq_b``). This version runs the
model as it is, then with the width lowered to 512 (``kv_a_proj_with_mqa`` padded too), then every one-row dot
plain, clearing the steps' jit cache between, in one process (the same autotuned GEMMs where they coincide). Prints
tok/s, step-call p50 and whether greedy tokens agree (they need not: a GEMM sums in another order than the reduce).

    JAX_PLATFORMS=cuda,cpu python experiments/results/probes/matvec_rows.py OUT.json [prompt_len] [new_tokens]

``PROBE_CONFIG=tiny`` runs it on a CPU (a smoke test of the probe itself).
"""
import importlib
import json
import os
import sys

import jax.numpy as jnp
import numpy as np

import glm53
from glm53 import model as model_lib

out_path = sys.argv[1]
prompt_len = int(sys.argv[2]) if len(sys.argv) > 2 else 8192
new_tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 512
THRESHOLD = 10_000_000  # XLA's size threshold (elements of both operand matrices)

c = importlib.import_module("configs." + os.environ.get("PROBE_CONFIG", "h200_bench")).get_config()
cc = glm53.CacheConfig.from_config_dict(c.cache)
model = glm53.from_config(c.model, seed=c.seed, dtype=c.dtype, cache_config=cc)
prompt = np.random.default_rng(0).integers(0, c.model.vocab_size, prompt_len).tolist()
cache = cc.replace(mode="resident", max_len=prompt_len + max(new_tokens, 66) + 8)


def run(label):
    glm53.generate(model, [prompt], max_new_tokens=66, cache=cache)  # compile, untimed
    r = glm53.generate(model, [prompt], max_new_tokens=new_tokens, cache=cache)
    fig = {"decode_tokens_per_s": r.decode_tokens_per_s, "step_call_ms_p50": r.decode_step_call_ms["p50"],
           "tokens": r.tokens[0]}
    print(f"[{label}] {r.decode_tokens_per_s:.1f} tok/s, step calls p50 {r.decode_step_call_ms['p50']:.3f} ms",
          flush=True)
    return fig


# The runs: the model as it is (``glm53.model.matmul`` pads one-row dots at least _TWO_ROW_MIN_WIDTH wide: the
# indexer's wq_b), then with kv_a_proj_with_mqa (576 wide) padded too, then every one-row dot plain (XLA
# strength-reduces them). ``matmul`` reads the width at trace time, so clearing the jit cache is enough.
runs = {}
for label, width in [("two_row", model_lib._TWO_ROW_MIN_WIDTH), ("two_row_from_512", 512),
                     ("plain_dot", 1 << 40)]:
    model_lib._TWO_ROW_MIN_WIDTH = width
    model.steps._jits.clear()
    model.steps._others.clear()
    runs[label] = run(label)
base, variant = runs["two_row"], runs["plain_dot"]
same = base["tokens"] == variant["tokens"]
first_diff = next((i for i, (a, b) in enumerate(zip(base["tokens"], variant["tokens"])) if a != b), None)
for label, r in runs.items():
    print(f"{label}: {r['decode_tokens_per_s'] / variant['decode_tokens_per_s']:.3f} x plain")
print(f"greedy tokens identical (the model vs plain): {same} (first difference at {first_diff})")
json.dump({"prompt_len": prompt_len, "new_tokens": new_tokens, **runs,
           "tokens_identical": same, "first_difference": first_diff,
           "command": "python experiments/results/probes/matvec_rows.py " + " ".join(sys.argv[1:])},
          open(out_path, "w"), indent=1)
