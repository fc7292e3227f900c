"""Which cache parameters the compiled decode steps copy, at a real config and lane count.

    python -m experiments.step_copies --config=configs/h200_bench.py --config.run.prompt_len=50000 \
        --config.run.batch=10 --out=$OUT/step_copies.json

A step donates the cache and updates it in place; where XLA cannot order a read of a buffer before its in-place
write it copies the buffer first (a ~1 us kernel for a session scalar, ~90 us for a 10-lane ring). On a GPU
``tests/test_step_copies.py`` checks the tiny config, but the schedule, and with it the copies, depends on the
config: the four copies of ``lengths`` and ``mtp_lengths`` of the 10-lane ``configs/h200_bench.py`` step (until
abf301d) never showed at the tiny one. This compiles the steps of ``run.batch`` lanes for each cache mode (plain
decode with and without the copyback (offload) and with and without the benchmarks' selection override; with
``--mtp=D`` also the verify step of D drafts and the drafting step) and lists the copied cache parameters
(``copy(%cache_...)`` in the compiled HLO). Only compiling: no prefill, nothing decoded. The
schedule differs by backend, so the figure that matters is the accelerator's.
"""

import json

import jax
import jax.numpy as jnp
from absl import flags

import glm53
from experiments import cli, workloads
from experiments.trace_util import compiled_decode_hlo, copied_cache_params
from glm53.provenance import provenance

FLAGS = flags.FLAGS
cli.define_config("configs/h200_bench.py", "experiment config")
flags.DEFINE_string("out", "", "write the results JSON here")
flags.DEFINE_list("modes", ["resident", "offload"], "cache modes")
flags.DEFINE_integer("mtp", 0, "also compile the MTP verify and draft steps of this depth (0: plain decode only)",
                     lower_bound=0, upper_bound=glm53.engine.MAX_MTP_DEPTH)


def main(_):
    c = FLAGS.config
    cli.check_checkpoint(c, reads_checkpoint=False)
    cli.refuse_unread_overrides(
        ("model", "seed", "dtype", "mesh", "run.prompt_len", "run.batch", "run.max_new_tokens")
        + cli.cache_fields_but(c, "max_len", "mode"),
        "experiments.step_copies compiles the decode steps of the --modes given, for run.batch lanes and a capacity "
        "of prompt + new tokens, and runs nothing (it reads config.model, seed, dtype, mesh, "
        "run.{prompt_len,batch,max_new_tokens} and cache but its mode and max_len)")
    model, _, cc, K = workloads.setup(c)
    B = c.run.batch
    results = {"config": c.to_dict(), **provenance(), "lanes": B, "steps": {}}
    for mode in FLAGS.modes:
        mc = cc.replace(mode=mode)
        e = glm53.Engine(model, cache=mc, max_sessions=B)
        lanes, bucket = e._lanes(list(range(B)))
        pages = glm53.offload.copy_pages_for(mc, 1) if mode == "offload" else 0
        for p in sorted({pages, 0}):
            for sel in (None, jnp.zeros((bucket, K), jnp.int32)):
                hlo = compiled_decode_hlo(model, e, lanes, bucket, sel, p)
                name = f"{mode} decode, copy_pages={p}, selection override {'yes' if sel is not None else 'no'}"
                results["steps"][name] = copied_cache_params(hlo)
                print(f"{name}: copies {results['steps'][name] or 'nothing'}", flush=True)
        D = FLAGS.mtp
        if D:
            i32 = jnp.zeros((bucket,), jnp.int32)
            f0, f1 = jnp.float32(0), jnp.float32(1)
            sel = jnp.zeros((bucket, K), jnp.int32)
            verify_pages = glm53.offload.copy_pages_for(mc, D + 1) if mode == "offload" else 0
            drafts = jnp.zeros((bucket, D), jnp.int32)
            calls = {
                f"{mode} verify, depth {D}": ("verify", (model.params, e.cache, lanes, i32, drafts, None, i32,
                                                          jnp.int32(0), f0, f1, e._stop_ids(None), sel),
                                              dict(greedy=True, accept_override=D, kernels=e.kernels,
                                                   copy_pages=verify_pages)),
                f"{mode} draft, depth {D}": ("draft", (model.params, e.cache, lanes, i32, jnp.int32(0), f0, f1, sel),
                                             dict(depth=D, greedy=True, kernels=e.kernels)),
            }
            for name, (step, args, kw) in calls.items():
                hlo = model.steps.lower(step, *args, **kw).compile().as_text()
                results["steps"][name] = copied_cache_params(hlo)
                print(f"{name}: copies {results['steps'][name] or 'nothing'}", flush=True)
        del e
    results["no_copies"] = not any(results["steps"].values())
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            json.dump(results, f, indent=2, default=str)
        print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
    cli.run(main)
