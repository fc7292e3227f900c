"""Probe: which of a decode loop's step calls record their CUDA graphs again, and why.

The 10-session ring runs (host_calls_ring_v1v2_engine10_b4ac251.json) had their slowest calls at steps 1-3 of every
run, the first call of each of the ring's three executables: 2.4-4.6 ms against a 1.0-1.3 ms median, enough to set
the run's p99. XLA records an executable's command buffers (CUDA graphs) again when any buffer they use moved
(``CommandBufferThunk::ShouldUpdateCommandBuffer``: arguments, outputs, and the temporaries' allocation), and drops
every executable's graphs whenever a new executable with command buffers is loaded (``EvictCommandBuffers``). Its
VLOG 3 says which happened; this probe puts markers around every step call so each log line can be placed.

Run (stderr is the log; the parse reads it back):

    TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3 python cmdbuf_updates.py run 2> LOG
    python cmdbuf_updates.py parse LOG OUT.json

``python cmdbuf_updates.py ab <flags of experiments.sessions_ab>`` marks the A/B's own runs the same way (``ab``).

With ``TF_CPP_VMODULE=command_buffer_thunk=3,bfc_allocator=3`` the parse also lists the device allocations each loop
step made (its temporaries' address: which calls found them moved) and how many were made outside the steps.

PROBE_SESSIONS (10), PROBE_HISTORY (8192), PROBE_NEW (48) tokens a run, PROBE_RUNS (3) runs after the warm-up,
PROBE_RING (the engine's default when unset), PROBE_MODE (offload; resident), PROBE_MTP (0; D: MTP D with D
drafts accepted, ``accept_override``), PROBE_WORKLOAD (local99; indexer: the model's own selection, no
override), PROBE_FRESH (0; 1: a fresh workload each run, ``workloads.selection``, instead of one
``workloads.Selections`` series, whose runs share one set of device buffers), PROBE_CONFIG (h200_bench).
Compilations are logged too (``jax_log_compiles``), to name what a between-runs eviction came from.
"""
import collections
import json
import os
import re
import sys


def _mark(text):
    sys.stderr.flush()
    os.write(2, f"@@ {text}\n".encode())


def _mark_step_calls(state):
    """Marks every step call of every engine, the rings' and the plain jitted steps' (``Engine._step``): ``call
    <run> <n> begin <name> <loop step or ->`` before it, ``call <run> <n> end`` after (``state``: the run's name,
    its call count and its loop step count, which a decode or verify call advances)."""
    from glm53 import engine as eng

    def around(name, f, *a, **kw):
        state["call"] += 1
        step = "-"
        if name in ("decode", "verify"):  # a decode loop's step: its place in ``step_call_s``, 1-based
            state["step"] += 1
            step = state["step"]
        _mark(f"call {state['run']} {state['call']} begin {name} {step}")
        out = f(*a, **kw)
        _mark(f"call {state['run']} {state['call']} end")
        return out

    ring_call, step = eng._StepRing.__call__, eng.Engine._step

    def marked_step(self, name):
        f = step(self, name)
        return lambda *a, **kw: around(name, f, *a, **kw)

    eng._StepRing.__call__ = lambda self, name, args, static: around(name, ring_call, self, name, args, static)
    eng.Engine._step = marked_step


def run():
    import jax
    import numpy as np

    import glm53
    from experiments import sessions_ab, workloads
    import importlib

    S = int(os.environ.get("PROBE_SESSIONS", "10"))
    hist = int(os.environ.get("PROBE_HISTORY", "8192"))
    new = int(os.environ.get("PROBE_NEW", "48"))
    c = importlib.import_module("configs." + os.environ.get("PROBE_CONFIG", "h200_bench")).get_config()
    c.run.prompt_len = hist
    c.cache.mode = os.environ.get("PROBE_MODE", "offload")
    mtp = int(os.environ.get("PROBE_MTP", "0"))
    cc = glm53.CacheConfig.from_config_dict(c.cache)
    model = glm53.from_config(c.model, seed=c.seed, dtype=c.dtype, cache_config=cc)
    cc = cc.replace(max_len=hist + 16 + new + 64)
    K = min(model.config.index_topk, cc.max_len)
    e, sids, _ = sessions_ab.build(model, cc, c, S, suffix=16)
    if os.environ.get("PROBE_RING"):
        e.output_ring = int(os.environ["PROBE_RING"])

    mark = _mark
    state = {"run": "warmup", "call": 0, "step": 0}
    _mark_step_calls(state)
    jax.config.update("jax_log_compiles", True)
    results = []
    workload = os.environ.get("PROBE_WORKLOAD", "local99")
    selections = workloads.Selections(workload, K, hist, S)
    for r in ["warmup"] + list(range(int(os.environ.get("PROBE_RUNS", "3")))):
        state.update(run=r, call=0, step=0)
        mark(f"run {r} begin")
        override = (workloads.selection(workload, K, hist, 7, S) if os.environ.get("PROBE_FRESH") == "1"
                    else selections(7))
        out = e.generate({s: new for s in sids}, selection_override=override, mtp=mtp,
                         accept_override=mtp if mtp else None)
        mark(f"run {r} end")
        calls = np.asarray(e.last_run.step_call_s) * 1e3
        results.append({"run": r, "call_ms": [round(float(x), 3) for x in calls],
                        "call_p50_ms": float(np.median(calls)), "call_p99_ms": float(np.percentile(calls, 99)),
                        "tokens": hash(tuple(tuple(out[s]) for s in sids))})
        for s in sids:
            e.rollback(s, len(out[s]))
        mark(f"between {r} end")
    os.write(2, ("@@ results " + json.dumps(results) + "\n").encode())


def ab(argv):
    """The same log for ``experiments.sessions_ab`` as it runs (``python cmdbuf_updates.py ab <its flags>``): every
    ``Engine.generate`` is a run, named by its engine's mode and a count (``offload3``), its step calls marked as
    ``run`` marks them; the runs' step-call times go to the log's results line at exit."""
    import atexit

    from absl import app

    from glm53 import engine as eng
    from experiments import sessions_ab

    mark = _mark
    state = {"run": "setup", "call": 0, "step": 0, "count": collections.Counter()}
    results = []
    _mark_step_calls(state)

    generate = eng.Engine.generate

    def marked_generate(self, *a, **kw):
        mode = "offload" if self.offload else "resident"
        state["count"][mode] += 1
        state.update(run=f"{mode}{state['count'][mode]}", call=0, step=0)
        mark(f"run {state['run']} begin")
        out = generate(self, *a, **kw)
        mark(f"run {state['run']} end")
        calls = [round(1e3 * x, 3) for x in self.last_run.step_call_s]
        if calls:
            results.append({"run": state["run"], "call_ms": calls, "call_p50_ms": float(np.median(calls)),
                            "call_p99_ms": float(np.percentile(calls, 99)), "mtp": kw.get("mtp", 0)})
        mark(f"between {state['run']} end")
        return out

    import numpy as np
    eng.Engine.generate = marked_generate
    atexit.register(lambda: os.write(2, ("@@ results " + json.dumps(results) + "\n").encode()))
    jax_log_compiles()
    app.run(sessions_ab.main, argv=["sessions_ab", *argv])


def jax_log_compiles():
    import jax
    jax.config.update("jax_log_compiles", True)


def parse(log_path, out_path):
    """Per run, per step name: calls, calls that recorded their command buffer again (and how many allocations had
    moved), and the recording's host time. XLA's log at JAX 0.11.2 (command_buffer_thunk.cc): "Create/Update
    command buffer ... updated_allocs=N", "Updated command buffer in N us", "Initialize command buffer ... by
    recoding" (a graph made anew, after XLA evicted every executable's graphs because a new one was loaded),
    "Execute command buffer; num_executions=N" (1 right after a recording)."""
    run, name, step = None, None, None
    recorded_steps = collections.defaultdict(set)  # run -> the loop steps (1-based) that recorded
    table = collections.defaultdict(lambda: collections.Counter())
    record_us = collections.defaultdict(list)
    evicted = collections.Counter()
    compiles = collections.defaultdict(list)
    results = None
    # With ``bfc_allocator=3`` in TF_CPP_VMODULE: the device allocations made inside each call, in order, as
    # (bytes, address) (the allocator's "AllocateRaw <name>  <bytes> <address>" line; its deallocation line names no
    # address). A ring step allocates only its temporaries, so a decode call's list says where they went.
    allocations = collections.defaultdict(list)  # (run, call name, loop step or None, call number) -> [(bytes, ptr)]
    call_number = None
    for line in open(log_path, errors="replace"):
        if line.startswith("@@ results "):
            results = json.loads(line[len("@@ results "):])
            continue
        if line.startswith("@@ "):
            w = line.split()
            if w[1] == "run":
                run = w[2]
            if w[1] == "call" and w[4] == "begin":
                name = w[5]
                call_number = w[3]
                step = int(w[6]) if len(w) > 6 and w[6] != "-" else None
                table[(run, name)]["calls"] += 1
            elif w[1] == "call" or w[1] == "between":
                name = "between_calls" if w[1] == "call" else "between_runs"
                step = None
            continue
        key = (run, name or "setup")
        if m := re.search(r"AllocateRaw \S+  (\d+) (0x[0-9a-f]+)", line):
            allocations[(run, name or "setup", step, call_number if name else None)].append(
                (int(m.group(1)), m.group(2)))
            continue
        if "Initialize command buffer" in line:  # a graph made anew: the executable's were evicted (or never made)
            table[key]["recorded"] += 1
            table[key]["recorded_anew"] += 1
            if step is not None:
                recorded_steps[run].add(step)
        elif m := re.search(r"updated_allocs=(\d+)", line):
            table[key]["recorded"] += 1
            if step is not None:
                recorded_steps[run].add(step)
            table[key][f"recorded_with_{m.group(1)}_moved"] += 1
        elif m := re.search(r"(?:Updated|Initialized) command buffer.* in (\d+) ", line):
            record_us[key].append(int(m.group(1)))
        elif m := re.search(r"Evicted (\d+)", line):
            evicted[key] += int(m.group(1))
        elif "Finished XLA compilation" in line:
            compiles[key].append(line.strip()[-100:])
    # Each run's slowest step calls, and whether XLA recorded the step's graphs again in them.
    slowest = {}
    for res in results or []:
        ms = res.pop("call_ms", [])
        rec = recorded_steps.get(str(res["run"]), set())
        res["recorded_steps"] = sorted(rec)
        res["slowest"] = [[x, i + 1, (i + 1) in rec] for x, i in sorted(((x, i) for i, x in enumerate(ms)),
                                                                           reverse=True)[:10]]
        res["call_p50_recording_free_ms"] = float(sorted(x for i, x in enumerate(ms) if i + 1 not in rec)[
            len([i for i in range(len(ms)) if i + 1 not in rec]) // 2]) if len(ms) > len(rec) else None
    # Each loop step's allocations of 1 MiB or more (the temporaries), and what was allocated between two runs.
    big = {f"{r} {n} {st}": [a for a in al if a[0] >= 1 << 20] for (r, n, st, _), al in allocations.items()
           if st is not None}
    between = {f"{r} {n}": sum(len(al) for (r2, n2, st, _), al in allocations.items() if (r2, n2) == (r, n))
               for (r, n, st, _) in allocations if st is None}
    report = {"step_allocations_1mib": big, "allocations_outside_loop_steps": between,
              "results": results,
              "by_run_and_step": {f"{r} {n}": dict(c, record_us_total=sum(record_us[(r, n)]))
                                  for (r, n), c in table.items()},
              "evicted": {f"{r} {n}": v for (r, n), v in evicted.items()},
              "compiles_after_warmup": {f"{r} {n}": v for (r, n), v in compiles.items() if r not in (None, "warmup")}}
    json.dump(report, open(out_path, "w"), indent=1)
    for k, v in report["by_run_and_step"].items():
        if not k.startswith("None") and not k.startswith("warmup"):
            print(k, v)
    print("evicted", report["evicted"], "compiles after warm-up", report["compiles_after_warmup"])
    print(json.dumps(results))


if __name__ == "__main__":
    if sys.argv[1] == "run":
        run()
    elif sys.argv[1] == "ab":
        ab(sys.argv[2:])
    else:
        parse(sys.argv[2], sys.argv[3])
