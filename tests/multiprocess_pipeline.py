"""A session's life on pipeline stages spanning several processes (run by tests/test_distributed.py through
experiments.launch), or on one device for the baseline: open, generate (MTP or not), a long append, fork,
rollback, save, restore into a fresh engine, stats; in offload mode the generate calls record a selection trace.
Then the model's own save (``Model.save``, written by the one-device baseline beside DIR: model-save) read back
onto the layout by ``glm53.load``, in its dtype and in bfloat16: its digest, and a hash of every parameter each
process holds (OUT.p<i>.weights.json). Process 0 writes the tokens, the logits, the trace and the digests.

    python -m experiments.launch --processes=2 --devices_per_process=8 -- \
        python tests/multiprocess_pipeline.py OUT DIR CONFIG STAGES TP MODE MTP KV_FORMAT

CONFIG: "mesh" (engine_common.MESH_CFG, 3 layers) or "pipe" (PIPE_CFG, 16 layers: one a stage on 16 devices).
"""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # engine_common, and glm53 where it is not installed

from glm53 import distributed  # noqa: E402
from multiprocess_compile import share_compilations  # noqa: E402

distributed.initialize()
share_compilations()

import jax  # noqa: E402
import numpy as np  # noqa: E402

import glm53  # noqa: E402
from glm53.trace import TraceRecorder  # noqa: E402
from engine_common import MESH_CFG, PIPE_CFG  # noqa: E402


def _held_bytes(model) -> dict:
    """sha256 of each parameter this process holds whole, by path; the last stage's copy of the embedding too."""
    import hashlib

    tree = {"params": model.params}
    if model.pipeline is not None and "embed_tokens" in model.pipeline.stage_params(model.params)[-1]:
        tree["last_stage_embedding"] = model.pipeline.stage_params(model.params)[-1]["embed_tokens"]
    return {jax.tree_util.keystr(k): hashlib.sha256(np.asarray(x).tobytes()).hexdigest()
            for k, x in jax.tree_util.tree_leaves_with_path(tree) if x.is_fully_addressable}


def main(out: str, directory: str, config: str, stages: str, tp: str, mode: str, mtp: str, kv_format: str) -> None:
    stages, tp, mtp = int(stages), int(tp), int(mtp)
    cc = glm53.CacheConfig(mode=mode, kv_format=kv_format, prefill_chunk=16, copyback_every=16, hot_rows=64,
                           max_len=192)
    mesh = None if stages * tp == 1 else glm53.MeshConfig(stages=stages, tp=tp)
    model = glm53.from_config({"mesh": MESH_CFG, "pipe": PIPE_CFG}[config], seed=0, dtype="float32", cache_config=cc,
                              mesh=mesh)
    rng = np.random.default_rng(0)
    e = glm53.Engine(model, max_sessions=3)
    rec = TraceRecorder() if mode == "offload" else None  # every process records (each stage's rounds sent to all)
    a, b = e.open(rng.integers(0, 256, 37).tolist()), e.open(rng.integers(0, 256, 22).tolist())
    outs, logits = [], []
    outs.append(e.generate({a: 4, b: 5}, mtp=mtp, return_logits=True, trace=rec))
    logits.append(e.last_run.logits)
    e.append(a, rng.integers(0, 256, 80).tolist())  # past the hot cache
    c = e.fork(a)
    e.rollback(b, 2)
    outs.append(e.generate({a: 4, b: 2, c: 3}, mtp=mtp, return_logits=True, trace=rec))
    logits.append(e.last_run.logits)
    e.save(c, directory)
    r = glm53.Engine(model, max_sessions=1)
    got = r.restore(directory)
    restored = r.generate({got: 4}, mtp=mtp)[got]
    stats = e.stats(a)
    # The model's save, restored straight onto the stages (each process reading its stages' weights), in its dtype
    # and cast: its digest (each stage's weights' first values sent to every process), and every byte.
    native = os.path.join(os.path.dirname(directory), "model-save")
    if stages * tp == 1:  # the baseline, run first
        model.save(native)
    loaded = glm53.load(native, mesh=mesh)
    cast = glm53.load(native, mesh=mesh, dtype="bfloat16")
    # every byte of what this process holds (a stage lies in one process; the baseline holds all), for the test to
    # put the processes' together against the baseline's
    with open(f"{out}.p{jax.process_index()}.weights.json", "w") as f:
        json.dump({name: _held_bytes(m) for name, m in (("model", model), ("loaded", loaded), ("cast", cast))}, f)
    if distributed.is_writer():
        arrays = {f"{i}_{sid}": np.asarray(v) for i, run in enumerate(logits) for sid, v in run.items()}
        np.savez(out + ".npz", **arrays)
        if rec is not None:
            rec.save(out + ".trace.npz")
        with open(out, "w") as f:
            json.dump({"processes": jax.process_count(), "devices": len(jax.devices()),
                       "outs": [{str(k): v for k, v in o.items()} for o in outs], "restored": restored,
                       "hits": stats.get("hits"), "misses": stats.get("misses"),
                       "layers": len(stats["per_layer"]["hits"]) if mode == "offload" else None,
                       "memory": e.memory_report()["device"], "digest": model.params_digest(),
                       "loaded_digest": loaded.params_digest(), "cast_digest": cast.params_digest(),
                       "cast_dtypes": sorted({str(x.dtype) for x in jax.tree_util.tree_leaves(cast.params)})}, f)


if __name__ == "__main__":
    main(*sys.argv[1:9])
