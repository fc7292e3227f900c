"""Memory plan: will N sessions of a history fit a machine? Per-device and per-host bytes from shapes alone.

    python -m experiments.plan --config=configs/glm5.py --machine=article --sessions=15 --history=1048576
    python -m experiments.plan --config=configs/glm5.py --machine=h200x8 --expert_weights=fp8 --out=plan.json
    python -m experiments.plan --config=configs/h200_bench.py --machine=custom --devices=1 --device_gib=139 \
        --host_gib=125 --sessions=16 --history=1048576

``glm53.memory.plan`` counts what an engine would allocate: each device's shards of the parameters under
``glm53.sharding``'s rules (tp is the machine's device count over ``--config.mesh.stages``; a ``--config.mesh.tp``
other than that, or a layout no engine could run, is refused with what is wrong), the cache
(replicated over the mesh), the largest transient buffer and the host pool (one copy per device, in its host's
memory), and how many sessions of each history fit by device memory and by host memory. The same figures as
``Engine.memory_report()`` for the same engine (``tests/test_plan.py``).

``--compile`` adds what counting cannot know, the step's workspace: the decode step (``--mtp=D``: the verify step)
compiled ahead of time on abstract shapes for the machine's mesh, no weights and no cache allocated
(``glm53.memory.compiled_step_memory``), and the peak per device it runs in. The workspace is the backend's: run it
on the GPU the engine will use (the mesh must fit its devices); on a CPU the mesh is made of host devices and the
workspace is that of the jnp reference paths (whose MoE gathers the routed experts' weights), an upper bound of no
use for a GPU. The one committed CPU compile of the full GLM-5 (16 stages, FP8 experts:
``plan_glm5_article_stages16_fp8_compiled_cpu.json``) records 132 s.

    python -m experiments.plan --config=configs/h200_bench.py --machine=h200 --sessions=10 --history=50000 --compile

``--config.mesh.stages=S`` plans pipeline stages (``glm53.pipeline``): the machine's devices as S stages of
devices / S tensor-parallel devices, each stage holding its layers' weights, cache and host pool; a device's figures
are its stage's (the table gives the largest), a host holds the pools of its devices' stages; ``--compile`` then
compiles each stage's programs (``glm53.memory.compiled_stage_memory``).

    python -m experiments.plan --config=configs/glm5.py --config.mesh.stages=16 --machine=article
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
from absl import app, flags

from experiments import cli
import glm53
from glm53 import memory
from glm53.params import resolve_dtype
from glm53.provenance import provenance

GiB = 1 << 30
MACHINES = memory.MACHINES

FLAGS = flags.FLAGS
cli.define_config("configs/glm5.py", "experiment config (model, cache, mesh)")
flags.DEFINE_enum("machine", "article", list(MACHINES) + ["custom"], "machine sizes (custom: the flags below)")
flags.DEFINE_integer("devices", 0, "--machine=custom: devices (the tp mesh)")
flags.DEFINE_float("device_gib", 0.0, "--machine=custom: GiB per device")
flags.DEFINE_float("host_gib", 0.0, "--machine=custom: GiB of host memory per host")
flags.DEFINE_integer("devices_per_host", 0, "--machine=custom: devices per host (0: all of them on one)")
flags.DEFINE_integer("sessions", 15, "concurrent sessions", lower_bound=1)
flags.DEFINE_list("history", ["50000", "200000", "1048576"], "history lengths (tokens per session)")
flags.DEFINE_enum("expert_weights", "model", ["model", "fp8"], "experts in the model dtype or FP8 (block-scaled)")
flags.DEFINE_string("out", "", "write the plan JSON here")
flags.DEFINE_bool("compile", False, "also compile the decode step (--mtp: the verify step) ahead of time on abstract "
                  "shapes for the machine's mesh and add XLA's workspace (glm53.memory.compiled_step_memory); on a "
                  "CPU the mesh is made of host devices and the workspace is the jnp references'")
flags.DEFINE_integer("mtp", 0, "--compile: 0 compiles the decode step, 1-3 the MTP verify step of that depth",
                     lower_bound=0, upper_bound=memory.MAX_MTP_DEPTH)


def main(_):
    if FLAGS.compile and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        # Before the backend starts: enough host devices for the machine's mesh (the CPU backend only).
        n = FLAGS.devices if FLAGS.machine == "custom" else MACHINES[FLAGS.machine][0]
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}")
    c = FLAGS.config
    cli.check_checkpoint(c, reads_checkpoint=True)  # its config: the shapes counted are the checkpoint's
    cli.refuse_unread_overrides(
        ("model", "dtype", "checkpoint", "mesh") + cli.cache_fields_but(c, "max_len"),
        "experiments.plan counts config.model (or the checkpoint's), dtype, mesh and cache but its max_len: the rows "
        "come from --history, the sessions from --sessions and the devices from --machine")
    histories = cli.token_counts("history", FLAGS.history)
    cfg = cli.model_config(c)
    cc = glm53.CacheConfig.from_config_dict(c.cache)
    cli.refuse_an_unrunnable_cache(cfg, cc)  # what Engine refuses is no engine to plan
    if FLAGS.machine == "custom":
        if FLAGS.devices < 1 or FLAGS.device_gib <= 0 or FLAGS.host_gib <= 0:
            raise app.UsageError("--machine=custom needs --devices, --device_gib and --host_gib")
        devices, device_gib, host_gib = FLAGS.devices, FLAGS.device_gib, FLAGS.host_gib
        per_host = FLAGS.devices_per_host or devices
    else:
        devices, device_gib, host_gib, per_host = MACHINES[FLAGS.machine]
    try:
        mesh_shape = memory.machine_mesh(cfg, c.get("mesh"), devices)
        # --compile: the machine's mesh of this process's devices, made before anything is planned (too few
        # devices is one line now, not a traceback after the first history's table)
        mesh = (glm53.sharding.make_mesh(glm53.MeshConfig(stages=mesh_shape["stage"], tp=mesh_shape["tp"]))
                if FLAGS.compile else None)
    except glm53.ConfigError as e:
        how = "" if FLAGS.machine == "custom" else " (--machine=custom --devices=N plans another machine)"
        sys.exit(f"experiments.plan: {e}{how}")
    stages = mesh_shape["stage"]
    rows = []
    n = cfg.param_count()
    params = cli.params_text(n)
    print(f"{cfg.num_hidden_layers} layers + {cfg.num_nextn_predict_layers} MTP, {params} parameters "
          f"({FLAGS.expert_weights} experts, {c.dtype}), cache {cc.mode}/{cc.kv_format}, index keys "
          f"{cc.index_keys}; machine {FLAGS.machine}: {devices} devices x {device_gib:g} GiB, {host_gib:g} GiB of host "
          f"memory per host, {per_host} devices per host; "
          + (f"tensor parallel over {devices}" if stages == 1 else
             f"{stages} pipeline stages x tensor parallel over {devices // stages}"))
    head = (f"{'history':>10} {'sessions':>8} {'params/dev':>11} {'cache/dev':>10} {'transient':>10} {'total/dev':>10} "
            f"{'fits':>5} {'max by dev':>10} {'host/host':>10} {'fits':>5} {'max by host':>11}")
    print(head)
    for h in histories:
        p = memory.plan(cfg, cc, sessions=FLAGS.sessions, history=h, dtype=resolve_dtype(c.dtype),
                        mesh_shape=mesh_shape, expert_weights=FLAGS.expert_weights,
                        device_bytes=int(device_gib * GiB), host_bytes=int(host_gib * GiB),
                        devices_per_host=per_host)
        rows.append(p)
        d = p["per_device"]
        print(f"{h:>10,} {FLAGS.sessions:>8} {d['params'] / GiB:>10.2f}G {d['cache'] / GiB:>9.2f}G "
              f"{d['transient'] / GiB:>9.2f}G {d['total'] / GiB:>9.2f}G {str(p['fits_device']):>5} "
              f"{p['max_sessions_by_device']:>10} {p['per_host']['total'] / GiB:>9.2f}G "
              f"{str(p.get('fits_host', '-')):>5} {str(p.get('max_sessions_by_host', '-')):>11}")
        if stages > 1:
            worst = max(p["stages"], key=lambda st: st["total"])
            print(f"{'':>10} stages of {min(len(st['layers']) for st in p['stages'])}-"
                  f"{max(len(st['layers']) for st in p['stages'])} layers; the fullest holds layers "
                  f"{worst['layers'][0]}-{worst['layers'][-1]}: params {worst['params'] / GiB:.2f}G, cache "
                  f"{worst['cache'] / GiB:.2f}G, pool {worst['pool'] / GiB:.2f}G per device")
        if not p["fits_loading"]:
            print(f"{'':>10} loading the weights needs {d['loading'] / GiB:.2f}G on the device they are made on, "
                  f"more than its {device_gib:g} GiB: its share and the largest weight twice")
        big = sorted(d["cache_parts"].items(), key=lambda kv: -kv[1])[:3]
        print(f"{'':>10} largest cache parts per device: " + ", ".join(f"{k} {v / GiB:.2f}G" for k, v in big))
        if FLAGS.compile and stages > 1:
            r = memory.compiled_stage_memory(cfg, cc, sessions=FLAGS.sessions, history=h,
                                             dtype=resolve_dtype(c.dtype), mesh=mesh,
                                             expert_weights=FLAGS.expert_weights, mtp=FLAGS.mtp)
            r["fits_device"] = r["peak_bytes"] <= device_gib * GiB
            p["compiled"] = r
            worst = max(r["stages"], key=lambda st: st["peak_bytes"])
            print(f"{'':>10} compiled {r['step']} per stage ({r['backend']}, {r['compile_s']:.0f} s): largest "
                  f"workspace {r['temp_bytes'] / GiB:.2f}G; peak {r['peak_bytes'] / GiB:.2f}G per device (the stage "
                  f"of layers {worst['layers'][0]}-{worst['layers'][-1]}), fits {r['fits_device']}")
        elif FLAGS.compile:
            r = memory.compiled_step_memory(cfg, cc, sessions=FLAGS.sessions, history=h, dtype=resolve_dtype(c.dtype),
                                            mesh=mesh, expert_weights=FLAGS.expert_weights, mtp=FLAGS.mtp)
            r["fits_device"] = r["peak_bytes"] <= device_gib * GiB
            p["compiled"] = r
            fresh = (r["output_bytes"] - r["alias_bytes"]) / GiB
            print(f"{'':>10} compiled {r['step']} ({r['backend']}, {r['compile_s']:.0f} s): workspace "
                  f"{r['temp_bytes'] / GiB:.2f}G, outputs not in place {fresh:.2f}G, "
                  f"peak {r['peak_bytes'] / GiB:.2f}G per device, fits {r['fits_device']}")
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            json.dump({"config": c.to_dict(), **provenance(), "machine": FLAGS.machine,
                       "devices": devices, "device_gib": device_gib, "host_gib": host_gib,
                       "expert_weights": FLAGS.expert_weights, "sessions": FLAGS.sessions, "plans": rows,
                       "devices_per_host": per_host,
                       "note": "counted from shapes; with --compile each plan's 'compiled' entry adds XLA's "
                               "memory analysis of the step compiled on that backend (a CPU's workspace is the jnp "
                               "references', not the GPU kernels'); with tensor parallelism every device of a stage "
                               "holds its stage's whole cache, its host pool included (one copy per device in its "
                               "host's memory); with pipeline stages each stage holds only its layers' weights, "
                               "cache and pool ('stages' in each plan)"}, f, indent=2, default=lambda o: o.item()
                      if isinstance(o, np.generic) else str(o))
        print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
    cli.run(main)
