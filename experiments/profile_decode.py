"""Where a decode step's device time goes: resident vs offload, kernel by kernel, from a JAX profiler trace.

    python -m experiments.profile_decode --config=configs/h200_bench.py --config.run.prompt_len=50000 \
        --config.run.max_new_tokens=64 --workload=local99 --out=experiments/results/profile_decode_50k.json

Each mode runs one untimed generate (compilation), then one generate under ``jax.profiler.trace``. From the trace's
device plane it sums, for the decode step's module (``jit_decode``; offload's copyback runs inside it, first), every
kernel's device time per decode step, and attributes kernels to source code through the compiled HLO's ``op_name``
metadata (Flax module paths and the ``jax.named_scope``s of ``glm53.offload``: ``offload_copyback``,
``offload_classify``, ``offload_gather``, ``offload_fill``, ...).
``span`` is the device timeline from the first to the last decode kernel per step; ``idle`` is the time in it when
nothing ran, charged to the kernel that ended each gap (``idle_before_*``): launch gaps and waits on the host, which
kernel sums alone would hide. The trace runs without the Python tracer, whose overhead would create gaps itself.
``--trace_dir=DIR`` keeps each mode's trace (``DIR/<mode>``) for TensorBoard or Perfetto; by default it is removed
once read.
Figures are device time, not a speed benchmark: use ``experiments.offload_ab`` for tokens/s.
"""

import collections
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

import glm53
from experiments import cli, trace_util, workloads
from experiments.trace_util import (by_op, compiled_decode_hlo, device_events, find_xplane, host_events, host_time,
                                    kernel_op_name, kernel_scope, op_names_from_hlo, trace_options)
from glm53.provenance import provenance

FLAGS = flags.FLAGS
cli.define_config("configs/h200_bench.py", "experiment config")
flags.DEFINE_string("out", "", "write the results JSON here")
flags.DEFINE_string("workload", "local99", f"selection: {workloads.WORKLOADS}; drift0.001 (99.95% hits) isolates "
                    "the offload step's fixed cost from its misses")
flags.DEFINE_list("modes", ["resident", "offload"], "cache modes to profile")
flags.DEFINE_integer("top", 40, "kernels listed per mode", lower_bound=0)
flags.DEFINE_string("trace_dir", "", trace_util.TRACE_DIR_HELP + " (a subfolder per mode)")

DECODE_MODULE = "jit_decode"  # glm53.steps names each compiled step jit_<step>


def program_op_names(events, op_names_by_pages: dict) -> dict:
    """``program_id`` -> the op_names of the decode executable it is. With two (offload: with and without the
    copyback), the one with it runs ``copy_blocks`` at every step, a page due or not; the other never does."""
    decode = [e for e in events if str(e[3].get("hlo_module", "")).startswith(DECODE_MODULE)]
    programs = {str(e[3].get("program_id")) for e in decode}
    copying = {str(e[3].get("program_id")) for e in decode if "copy_blocks" in e[0]}
    with_copy, without = op_names_by_pages[max(op_names_by_pages)], op_names_by_pages[min(op_names_by_pages)]
    if "None" in programs or (len(op_names_by_pages) > 1 and not copying):
        # events that do not say their executable (a CPU's host thunks), or no copy kernel to tell them by (the
        # reference copy on a CPU): both executables' names, the copying one's first
        merged = {**without, **with_copy}
        return {p: merged for p in programs}
    return {p: with_copy if p in copying else without for p in programs}


def summarise(events, op_names_by_pages: dict, decode_steps: int) -> dict:
    """``op_names_by_pages``: the op_names of each decode executable, by its copyback pages (0: none)."""
    names_of = program_op_names(events, op_names_by_pages)
    main_names = op_names_by_pages[max(op_names_by_pages)]
    per_kernel = collections.defaultdict(lambda: [0, 0.0, "", ""])
    per_scope = collections.Counter()
    per_module = collections.Counter()
    decode = [e for e in events if str(e[3].get("hlo_module", "")).startswith(DECODE_MODULE)]
    starts = [e[1] for e in decode]
    ends = [e[1] + e[2] for e in decode]
    t0, t1 = (min(starts), max(ends)) if decode else (0, 0)
    idle_before = collections.Counter()  # device idle time right before a kernel, by its scope
    idle_before_kernel = collections.Counter()
    frontier = None  # the latest end of any event so far (streams overlap: a gap is time nothing ran)
    # Launch units: a run of kernels from one command buffer (a CUDA graph, one host launch) or a kernel launched on
    # its own; more units per step means more host launches the device may wait for.
    launch_units, last_unit = 0, None
    outside_buffers = collections.Counter()
    outside_by_scope = collections.Counter()
    for name, start, dur, stats in sorted(events, key=lambda e: e[1]):
        module = str(stats.get("hlo_module", ""))
        per_module[module] += dur
        # The decode step (its copyback of host pages runs inside it, first).
        if not module.startswith(DECODE_MODULE):
            continue
        hlo_op = str(stats.get("hlo_op", ""))
        op_names = names_of.get(str(stats.get("program_id")), main_names)
        scope, op_name = kernel_scope(name, hlo_op, module, op_names)
        # The two executables number their kernels apart: a name that is another kernel in the copy-free one is
        # listed on its own.
        key = name if op_names is main_names or main_names.get(name, op_name) == op_name else f"{name} [copy-free]"
        k = per_kernel[key]
        k[0] += 1
        k[1] += dur
        k[2], k[3] = op_name, scope
        per_scope[scope] += dur
        unit = hlo_op if hlo_op.startswith("command_buffer") else None
        if unit is None or unit != last_unit:
            launch_units += 1
        if unit is None:
            outside_buffers[name] += 1
            outside_by_scope[scope] += 1
        last_unit = unit
        if frontier is not None and start > frontier:
            idle_before[scope] += start - frontier
            idle_before_kernel[name] += start - frontier
        frontier = start + dur if frontier is None else max(frontier, start + dur)
    decode_steps = max(decode_steps, 1)
    busy = sum(v[1] for v in per_kernel.values())
    steps = decode_step_events(events, names_of, decode_steps)  # split once: the steady state and the sequence
    sequence = step_sequence(steps, names_of)
    rows = sorted(per_kernel.items(), key=lambda kv: -kv[1][1])
    return {
        "decode_steps_profiled": decode_steps,
        "busy_us_per_step": busy / 1e3 / decode_steps,
        # Idle device time inside the decode window, charged to the kernel that ended it: where the device waited
        # (for a launch, the host, a transfer). Needs a light host tracer, or the profiler's own overhead shows.
        "idle_us_per_step": sum(idle_before.values()) / 1e3 / decode_steps,
        "idle_before_scope_us_per_step": {k: v / 1e3 / decode_steps for k, v in idle_before.most_common()},
        "idle_before_kernel_us_per_step": {k: v / 1e3 / decode_steps for k, v in idle_before_kernel.most_common(15)},
        "span_us_per_step": (t1 - t0) / 1e3 / decode_steps,
        "launch_units_per_step": launch_units / decode_steps,
        "kernels_outside_command_buffers_per_step": {k: v / decode_steps for k, v in outside_buffers.most_common(30)},
        "kernels_outside_command_buffers_by_scope_per_step": {k: v / decode_steps
                                                              for k, v in outside_by_scope.most_common()},
        "kernels_per_step": sum(v[0] for v in per_kernel.values()) / decode_steps,
        # 0 on a GPU means XLA built no command buffers for this run's step: not the program users run (XLA's
        # --xla_dump_to flags did that on the H200: 573 launch units a step instead of ~150).
        "kernels_in_command_buffers_per_step": (sum(v[0] for v in per_kernel.values())
                                                - sum(outside_buffers.values())) / decode_steps,
        # One decode step in device order: which kernels ran alone (host-launched one by one) and where the device
        # waited; the runs of lone kernels show what splits the command buffers.
        "middle_step_sequence": sequence,
        # The median step by scope (steady state) and the first step apart: read these, not the means, for what a
        # warm decode step costs.
        "steady_state": steady_state(steps, names_of),
        "per_scope_us_per_step": {k: v / 1e3 / decode_steps for k, v in per_scope.most_common()},
        "top_kernels": [{"kernel": n, "scope": v[3], "op_name": v[2][-160:],
                         "calls_per_step": v[0] / decode_steps, "us_per_step": v[1] / 1e3 / decode_steps}
                        for n, v in rows[: FLAGS.top]],
        "all_kernels": [[n, v[3], v[0], v[1], v[2][-160:]] for n, v in rows],  # kernel, scope, calls, total ns, op
        # Device time by the model's op summed over layers: what a change to one op did, comparable across builds
        # whose XLA numbers its fusions apart (the padded wq_b, d9ae3a9: by kernel name this took the compiled HLO).
        "us_per_step_by_op": by_op(rows, decode_steps),
        "device_ms_per_module": {k: v / 1e6 for k, v in per_module.most_common(12)},
        "example_event_stats": [{k: str(v)[:120] for k, v in e[3].items()} for e in events[:3]],
    }


def decode_step_events(events, names_of: dict, decode_steps: int) -> list:
    """The decode module's events split into steps, each in start order (``[]`` when they cannot be told apart).
    A step ends with its LM head (the ``GLM5.logits`` kernels, once a step in every decode executable) and what
    follows it before the next step's first kernel, here counted with the next step: each piece then holds one of
    every kernel a step runs, whichever executable ran it."""
    decode = sorted((e for e in events if str(e[3].get("hlo_module", "")).startswith(DECODE_MODULE)),
                    key=lambda e: e[1])
    if not decode or decode_steps < 1:
        return []
    ends, in_head = [], False
    for i, (name, _, _, stats) in enumerate(decode):
        op_name = kernel_op_name(name, str(stats.get("hlo_op", "")), names_of.get(str(stats.get("program_id")), {}))
        head = "GLM5.logits" in op_name
        if in_head and not head:
            ends.append(i)
        in_head = head
    if in_head:
        ends.append(len(decode))
    if len(ends) != decode_steps:
        return []
    return [decode[a:b] for a, b in zip([0] + ends[:-1], ends)]


def steady_state(steps: list, names_of: dict) -> dict:
    """Per-scope device time of the median step, and the first step apart. The per-step means above include the
    first decode step, in which an offload hot cache is still cold after the prefill: every selected row is a miss
    there (at 10 lanes x 50K its 8 hot gathers took 2.66 ms against a warm step's 0.11), which a mean over 47 steps
    spreads as ~54 us over every step (``profile_decode_50k_b10*.json`` read the hot gather as 20-36 us a layer
    where a warm step's takes 13.8 and the resident gather 11.3: ``profile_decode_50k_b10_drift0.001_7c8b9f2.json``)."""
    if not steps:  # decode_step_events could not tell the steps apart
        return {}
    per_step = []
    for step in steps:
        scopes = collections.Counter()
        for name, _, dur, stats in step:
            scope, _ = kernel_scope(name, str(stats.get("hlo_op", "")), str(stats.get("hlo_module", "")),
                                    names_of.get(str(stats.get("program_id")), {}))
            scopes[scope] += dur / 1e3
        scopes["busy"] = sum(dur for _, _, dur, _ in step) / 1e3
        scopes["span"] = (max(e[1] + e[2] for e in step) - step[0][1]) / 1e3
        per_step.append(scopes)
    names = set().union(*per_step)
    return {"steps": len(per_step),
            "median_us": {n: float(np.median([s.get(n, 0.0) for s in per_step])) for n in sorted(names)},
            "first_step_us": {n: per_step[0].get(n, 0.0) for n in sorted(names)},
            "busy_us_by_step": [round(s["busy"], 1) for s in per_step]}


def step_sequence(steps: list, names_of: dict) -> list:
    """The kernels of the middle decode step in start order: [kernel, scope, "graph" or "lone", start us (from the
    step's first kernel), duration us, idle us before it]."""
    if not steps:
        return []
    step = steps[len(steps) // 2]
    out, frontier = [], step[0][1]
    for name, start, dur, stats in step:
        hlo_op = str(stats.get("hlo_op", ""))
        scope, _ = kernel_scope(name, hlo_op, str(stats.get("hlo_module", "")),
                                names_of.get(str(stats.get("program_id")), {}))
        unit = "graph" if hlo_op.startswith("command_buffer") else "lone"
        out.append([name[:60], scope, unit, round((start - step[0][1]) / 1e3, 2), round(dur / 1e3, 2),
                    round(max(start - frontier, 0) / 1e3, 2)])
        frontier = max(frontier, start + dur)
    return out


def main(_):
    c = FLAGS.config
    cli.check_checkpoint(c, reads_checkpoint=False)
    cli.refuse_unread_overrides(
        ("model", "seed", "dtype", "mesh", "run.prompt_len", "run.batch", "run.max_new_tokens", "run.seed")
        + cli.cache_fields_but(c, "max_len", "mode"),
        "experiments.profile_decode profiles greedy decode without MTP in the --modes given, with a capacity of "
        "prompt + new tokens (it reads config.model, seed, dtype, mesh, run.{prompt_len,batch,max_new_tokens,seed} "
        "and cache but its mode and max_len), and writes --out")
    workloads.check_names("workload", [FLAGS.workload])  # before any compile, as a used trace folder below
    try:
        trace_util.check_trace_dir(FLAGS.trace_dir)
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    cli.check_modes(c, FLAGS.modes, "modes")
    model, prompts, cc, K = workloads.setup(c)
    new = c.run.max_new_tokens
    results = {"config": c.to_dict(), **provenance(), "workload": FLAGS.workload, "modes": {}}
    tokens = {}
    for mode in FLAGS.modes:
        mc = cc.replace(mode=mode)

        def run(keep_cache=False):
            override = workloads.selection(FLAGS.workload, K, c.run.prompt_len, c.run.seed)
            return glm53.generate(model, prompts, max_new_tokens=new, cache=mc, selection_override=override,
                                  keep_cache=keep_cache, progress=False)  # profiled: no terminal writes

        warm = run(keep_cache=True)  # compile every shape
        # The decode step's HLO, from arguments shaped like a decode call's (generate below runs greedy).
        e = warm.engine
        lanes, B = e._lanes(e.sessions)
        sel = None if FLAGS.workload == "indexer" else jnp.zeros((B, K), jnp.int32)
        copy_pages = glm53.offload.copy_pages_for(mc, 1) if mode == "offload" else 0
        # Offload decode runs as two executables: with the copyback, and without it on the steps where no page can
        # be due (glm53.engine._Run._copy_pages). Each has its own kernel names.
        hlos = {p: compiled_decode_hlo(model, e, lanes, B, sel, p) for p in sorted({copy_pages, 0})}
        del warm, e
        with trace_util.trace_folder(FLAGS.trace_dir, mode) as logdir:
            # No Python tracer and the lightest host tracer (trace_util.trace_options): the trace's own host
            # overhead would otherwise slow dispatch enough to leave the device idle between kernels that run back
            # to back.
            with jax.profiler.trace(logdir, profiler_options=trace_options()):
                res = run()
            path = find_xplane(logdir)
            events, host = device_events(path), host_events(path)
        tokens[mode] = res.tokens
        if FLAGS.out:
            for p, hlo in hlos.items():
                suffix = "_copy_free" if p == 0 and copy_pages else ""
                with open(os.path.join(os.path.dirname(FLAGS.out) or ".", f"decode_hlo_{mode}{suffix}.txt"), "w") as f:
                    f.write(hlo)
        summary = summarise(events, {p: op_names_from_hlo(h) for p, h in hlos.items()}, new - 1)
        # The host's side of the same steps: what a step call spends its time on (dispatch, PJRT's execute, XLA's
        # thunks and command buffers, the driver's launches), to tell a slow call's cause from the device's.
        decode = [e for e in events if str(e[3].get("hlo_module", "")).startswith(DECODE_MODULE)]
        if decode:
            summary["host"] = host_time(host, min(e[1] for e in decode),
                                        max(e[1] + e[2] for e in decode), new - 1)
        summary["step_call_ms_while_profiled"] = res.decode_step_call_ms
        summary["decode_tokens_per_s_while_profiled"] = res.decode_tokens_per_s
        if res.cache_stats:
            summary["decode_hit_rate"] = res.cache_stats["decode"]["hit_rate"]
        results["modes"][mode] = summary
        print(f"[{mode}] busy {summary['busy_us_per_step']:.1f} us/step, idle {summary['idle_us_per_step']:.1f} "
              f"us/step, span {summary['span_us_per_step']:.1f} us/step, {summary['kernels_per_step']:.0f} "
              f"kernels and {summary['launch_units_per_step']:.0f} launch units/step; idle before (us/step): "
              + ", ".join(f"{k} {v:.1f}" for k, v in list(summary["idle_before_scope_us_per_step"].items())[:8]),
              flush=True)
        if jax.default_backend() == "gpu" and summary["kernels_in_command_buffers_per_step"] == 0:
            print(f"[{mode}] WARNING: no decode kernel ran from a command buffer (CUDA graph): this step is not the "
                  "program users run (XLA_FLAGS with --xla_dump_to turned them off on the H200)", flush=True)
        for k, v in summary["per_scope_us_per_step"].items():
            print(f"    {k:>20}: {v:8.1f} us/step")
        for k, v in list(summary.get("host", {}).get("self_us_per_step", {}).items())[:12]:
            print(f"    host {v:8.1f} us/step  x{summary['host']['count_per_step'].get(k, 0):6.1f}  {k}")
        for r in summary["top_kernels"][:25]:
            print(f"    {r['us_per_step']:8.1f} us  x{r['calls_per_step']:5.1f}  {r['scope']:>18}  {r['kernel'][:60]}")
    if {"resident", "offload"} <= set(results["modes"]):
        r, o = results["modes"]["resident"], results["modes"]["offload"]
        scopes = set(r["per_scope_us_per_step"]) | set(o["per_scope_us_per_step"])
        diff = {s: o["per_scope_us_per_step"].get(s, 0.0) - r["per_scope_us_per_step"].get(s, 0.0) for s in scopes}
        results["offload_minus_resident_us_per_step"] = dict(sorted(diff.items(), key=lambda kv: -abs(kv[1])))
        results["offload_minus_resident_us_per_step"]["busy"] = o["busy_us_per_step"] - r["busy_us_per_step"]
        results["offload_minus_resident_us_per_step"]["idle"] = o["idle_us_per_step"] - r["idle_us_per_step"]
        results["offload_minus_resident_us_per_step"]["launch_units"] = (o["launch_units_per_step"]
                                                                         - r["launch_units_per_step"])
        results["offload_minus_resident_us_per_step"]["kernels"] = o["kernels_per_step"] - r["kernels_per_step"]
        print("offload - resident (us/step, means over the profiled steps):")
        for k, v in results["offload_minus_resident_us_per_step"].items():
            print(f"    {k:>20}: {v:+8.1f}")
        rm, om = r["steady_state"].get("median_us", {}), o["steady_state"].get("median_us", {})
        if rm and om:
            med = {s: om.get(s, 0.0) - rm.get(s, 0.0) for s in set(rm) | set(om)}
            results["offload_minus_resident_median_step_us"] = dict(sorted(med.items(), key=lambda kv: -abs(kv[1])))
            print("offload - resident (us, median steps: the steady state):")
            for k, v in results["offload_minus_resident_median_step_us"].items():
                print(f"    {k:>20}: {v:+8.1f}")
    if len(tokens) > 1:
        results["tokens_identical"] = len({json.dumps(t) for t in tokens.values()}) == 1
        print("tokens identical across modes:", results["tokens_identical"])
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            json.dump(results, f, indent=2, default=str)
        print(f"wrote {FLAGS.out} (and each mode's decode HLO beside it)")


if __name__ == "__main__":
    cli.run(main)
