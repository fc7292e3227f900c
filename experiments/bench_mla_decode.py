"""The sparse MLA decode-attention kernel (``kernels_pallas.mla_decode``) against the model's einsum attention.

At ``configs/h200_bench.py``'s widths (64 heads, latent 512, rope 64, top-k 2,048, bf16) for ``--queries`` query
rows (1: batch-1 decode; 10: the ten-session step; 40: its MTP-3 verify rows). Each launch shape is first compared
with the reference (max abs difference: the kernel rounds unnormalised probabilities, see its docstring), then
timed inside one jitted loop of ``--iters`` calls, each call's input depending on the last output, so no dispatch
is counted and XLA cannot hoist the call.

    python -m experiments.bench_mla_decode --out=experiments/results/bench_mla_decode.json
    python -m experiments.bench_mla_decode --tiny   # CPU smoke run (interpreted kernel, timings meaningless)
"""

import importlib
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from experiments import cli
from glm53.provenance import write_results

mla = importlib.import_module("kernels_pallas.mla_decode")

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "", "write the results JSON here")
flags.DEFINE_bool("tiny", False, "small sizes for a CPU smoke run")
flags.DEFINE_list("queries", ["1", "10", "40"], "query rows per call")
flags.DEFINE_integer("iters", 200, "calls per timed loop", lower_bound=1)
flags.DEFINE_list("block_rows", ["32", "64"], "row blocks to time")
flags.DEFINE_list("num_warps", ["4", "8"], "warps per program to time")
flags.DEFINE_list("parts", ["64x2", "64x4", "32x1", "32x2", "16x1"],
                  "program parts to time, each HEAD_BLOCKxCOLUMN_PARTS (heads per program x slices of the columns)")
flags.DEFINE_list("num_stages", ["2"], "software-pipelining stages to time")


def main(_):
    on_gpu = jax.default_backend() == "gpu"
    h, C, R, K = (64, 512, 64, 2048) if not FLAGS.tiny else (16, 64, 16, 128)
    iters = FLAGS.iters if not FLAGS.tiny else 2
    scale = 192 ** -0.5
    results = {"backend": jax.default_backend(), "device": jax.devices()[0].device_kind, "jax": jax.__version__,
               "heads": h, "latent": C, "rope": R, "topk": K, "dtype": "bfloat16", "iters": iters, "cases": []}

    def timed(fn, args):
        @jax.jit
        def loop(q_lat, q_rope, lat, rope, attend):
            def body(_, q):
                o = fn(q, q_rope, lat, rope, attend)
                return q + (o[:, :, :1] * 0).astype(q.dtype)  # depends on the call, changes nothing
            return jax.lax.fori_loop(0, iters, body, q_lat)

        jax.block_until_ready(loop(*args))
        times = []
        for _ in range(5):
            t = time.perf_counter()
            jax.block_until_ready(loop(*args))
            times.append(time.perf_counter() - t)
        return float(np.median(times)) / iters * 1e6

    for Q in map(int, FLAGS.queries):
        ks = jax.random.split(jax.random.key(Q), 5)
        args = (jax.random.normal(ks[0], (Q, h, C), jnp.bfloat16), jax.random.normal(ks[1], (Q, h, R), jnp.bfloat16),
                jax.random.normal(ks[2], (Q, K, C), jnp.bfloat16), jax.random.normal(ks[3], (Q, K, R), jnp.bfloat16),
                jax.random.uniform(ks[4], (Q, K)) < 0.98)
        want = mla.mla_decode_reference(*args, softmax_scale=scale)
        case = {"queries": Q, "reference_us": timed(lambda *a: mla.mla_decode_reference(*a, softmax_scale=scale),
                                                     args), "kernel": []}
        print(f"Q={Q}: reference {case['reference_us']:.2f} us", flush=True)
        for br, nw, part, ns in itertools.product(map(int, FLAGS.block_rows), map(int, FLAGS.num_warps),
                                                  FLAGS.parts, map(int, FLAGS.num_stages)):
            hb, cp = (int(x) for x in part.split("x"))
            if not mla.supported(h, C, R, K, br, min(hb, h), cp):
                continue
            kw = dict(softmax_scale=scale, block_rows=br, head_block=min(hb, h), column_parts=cp, num_warps=nw,
                      num_stages=ns, interpret=not on_gpu)
            shape = {"block_rows": br, "head_block": min(hb, h), "column_parts": cp, "num_warps": nw,
                     "num_stages": ns, "splits": mla.default_splits(Q, K, br, (h // min(hb, h)) * cp)}
            try:
                got = mla.mla_decode(*args, **kw)
                diff = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
                us = timed(lambda *a: mla.mla_decode(*a, **kw), args)
            except jax.errors.JaxRuntimeError as e:  # e.g. a launch shape whose tiles exceed shared memory
                case["kernel"].append({**shape, "error": str(e).splitlines()[0][:200]})
                print(f"  kernel {shape}: {str(e).splitlines()[0][:120]}", flush=True)
                continue
            case["kernel"].append({**shape, "us": us, "max_abs_diff": diff})
            print(f"  kernel {shape}: {us:.2f} us, max |kernel - reference| {diff:.2e}", flush=True)
        timed_ok = [k for k in case["kernel"] if "us" in k]
        if timed_ok:
            case["best"] = min(timed_ok, key=lambda k: k["us"])
            print(f"  best {case['best']['us']:.2f} us against the reference's {case['reference_us']:.2f}", flush=True)
        results["cases"].append(case)
    write_results(FLAGS.out, results)


if __name__ == "__main__":
    cli.run(main)
