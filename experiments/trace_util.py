"""Reading JAX profiler traces: the device events of a run, the source of each kernel (the compiled HLO's
``op_name`` metadata), the scope it belongs to, and the part of the model it does (shared by
``experiments.profile_decode`` and ``experiments.profile_prefill``).

    options = trace_options()                       # no Python tracer, the lightest host tracer
    with trace_folder(FLAGS.trace_dir, "offload") as logdir:   # kept there, or a temporary folder removed after
        with jax.profiler.trace(logdir, profiler_options=options):
            ...
        events = device_events(find_xplane(logdir))     # (name, start_ns, duration_ns, stats)
    op_names = op_names_from_hlo(compiled.as_text())
    scope, op_name = kernel_scope(name, stats["hlo_op"], stats["hlo_module"], op_names)

Kernels are attributed by name first where the name says where they come from (the Pallas kernels are named by
their ``pallas_call``), then through ``op_name``: the Flax module path (``GLM5/layers_3/self_attn/q_b_proj/...``)
and the ``jax.named_scope``s of ``glm53.cache`` / ``glm53.offload`` (``offload_copyback``, ``offload_gather``, ...).
A kernel that ran inside a command buffer (a CUDA graph) carries the command buffer as its ``hlo_op``; only its own
name (``fusion_12`` for the instruction ``fusion.12``) finds its metadata then.
"""

from __future__ import annotations

import collections
import contextlib
import glob
import os
import re
import tempfile

import jax
import jax.numpy as jnp

# The cache's own scopes (glm53.cache / glm53.offload) name a kernel first; otherwise the Flax module path does.
CACHE_SCOPES = ("offload_copyback", "offload_classify", "offload_gather", "offload_bulk_read", "offload_ring_write",
                "offload_fill", "resident_gather", "resident_write")

# Kernels whose names say where they come from (Pallas kernels are named by their pallas_call).
# Pallas kernels by their own name: inside a command buffer a kernel event's HLO op is the command buffer, and a
# Pallas call's kernel is named by the call, not by its HLO instruction, so neither finds its metadata (the MoE's
# grouped matmul was 1.2 ms a step of "unattributed" in profile_decode_8k_8f038d6.json).
KERNEL_SCOPES = (("hot_gather", "offload_gather"), ("fill_round", "offload_fill"), ("fill_rows", "offload_fill"),
                 ("copy_blocks", "offload_copyback"), ("gather_rows", "resident_gather"),
                 ("indexer_scores", "self_attn/indexer"), ("topk", "self_attn/indexer"), ("grouped_matmul", "mlp"))


def trace_options():
    """Profiler options without the Python tracer and with the lightest host tracer: the trace's own host overhead
    would otherwise slow dispatch enough to leave the device idle between kernels that normally run back to back."""
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    options.host_tracer_level = 1
    return options


TRACE_DIR_HELP = ("keep the profiler traces in this folder, one subfolder per run (open with TensorBoard's profile "
                  "plugin or Perfetto: the *.trace.json.gz); default: each trace is read, then removed")


def check_trace_dir(trace_dir: str) -> None:
    """Refuses, before any work, a ``--trace_dir`` that already holds a trace: find_xplane could not tell this run's
    from an earlier one's."""
    if trace_dir and glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True):
        raise ValueError(f"--trace_dir={trace_dir} already holds a profiler trace: give an empty or new folder")


@contextlib.contextmanager
def trace_folder(trace_dir: str, name: str):
    """The folder a ``jax.profiler.trace`` writes into: ``trace_dir/name``, kept, where ``trace_dir`` is given;
    otherwise a temporary folder, removed when the block ends. Each trace is tens of MB on a GPU, and the profiling
    entry points used to leave every one in the temp directory, unnamed."""
    if trace_dir:
        path = os.path.join(trace_dir, name)
        os.makedirs(path, exist_ok=True)
        yield path
        print(f"profiler trace kept in {path}", flush=True)
    else:
        with tempfile.TemporaryDirectory(prefix="glm53-trace-") as path:
            yield path


def find_xplane(logdir: str) -> str:
    """The one ``*.xplane.pb`` a ``jax.profiler.trace(logdir)`` wrote."""
    paths = glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)
    if len(paths) != 1:
        raise RuntimeError(f"expected one *.xplane.pb under {logdir}, found {paths}")
    return paths[0]


_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = [^\n]*?metadata=\{[^}]*op_name=\"([^\"]*)\"", re.M)
_LINE = re.compile(r"^\s*(ROOT )?%?([\w.\-]+) = ([^\n]*)$", re.M)
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) [^\n]*\{\s*$", re.M)


def _kernel_key(instruction: str) -> str:
    return re.sub(r"[.\-]", "_", instruction)


def op_names_from_hlo(hlo_text: str, *, infer: bool = False) -> dict[str, str]:
    """Instruction name -> op_name metadata for every instruction of the compiled module, keyed both as written
    (``fusion.12``) and as its GPU kernel is named (``fusion_12``: inside command buffers a kernel event carries the
    command buffer as its hlo_op, and only its own name says which fusion it is).

    ``infer``: an instruction without metadata of its own (XLA's gemm fusions and copies often have none) takes
    that of the computation it calls (its root's, else its first instruction's with metadata), else that of the
    first instruction that uses its result (two levels deep at most). A guess, but a local one: a fusion's consumer
    is almost always the same module's next op."""
    out = {}
    for m in _INSTR.finditer(hlo_text):
        out[m.group(1)] = m.group(2)
        out[_kernel_key(m.group(1))] = m.group(2)
    if not infer:
        return out
    comp_op = {}
    starts = [(m.start(), m.group(1)) for m in _COMPUTATION.finditer(hlo_text)]
    for i, (pos, name) in enumerate(starts):
        body = hlo_text[pos:starts[i + 1][0] if i + 1 < len(starts) else len(hlo_text)]
        root = re.search(r"^\s*ROOT [^\n]*?metadata=\{[^}]*op_name=\"([^\"]*)\"", body, re.M)
        first = _INSTR.search(body)
        if root:
            comp_op[name] = root.group(1)
        elif first:
            comp_op[name] = first.group(2)
    own, calls, users = {}, {}, {}
    for m in _LINE.finditer(hlo_text):
        name, rest = m.group(2), m.group(3)
        op = re.search(r'op_name="([^"]*)"', rest)
        if op:
            own[name] = op.group(1)
        c = re.search(r"\bcalls=%?([\w.\-]+)", rest)
        if c:
            calls[name] = c.group(1)
        for operand in set(re.findall(r"%([\w.\-]+)", rest.split("metadata=")[0])):
            users.setdefault(operand, []).append(name)

    def guess(name: str, depth: int) -> str:
        if name in own:
            return own[name]
        if calls.get(name) in comp_op:
            return comp_op[calls[name]]
        if depth:
            for u in users.get(name, ()):
                g = guess(u, depth - 1)
                if g:
                    return g
        return ""

    for m in _LINE.finditer(hlo_text):
        name = m.group(2)
        if name not in out:
            g = guess(name, 2)
            if g:
                out[name] = out[_kernel_key(name)] = g
    return out


def op_key(op_name: str, kernel: str) -> str:
    """The op a kernel ran for, with its layer left out (``GLM5/layers_*/self_attn/indexer/wq_b/dot_general``); a
    kernel without an op_name (a Pallas or library kernel) stands for itself."""
    if not op_name:
        return kernel
    return re.sub(r"layers_\d+", "layers_*", op_name.removeprefix("jit(decode)/"))


def by_op(rows, decode_steps: int) -> dict:
    """``{op: [kernels a step, us a step]}``, the most time first, from ``(kernel, (calls, ns, op_name, scope))``
    rows (an empty op_name: the kernel stands for itself)."""
    ops = collections.defaultdict(lambda: [0.0, 0.0])
    for name, (calls, ns, op_name, _) in rows:
        o = ops[op_key(op_name, name)]
        o[0] += calls / decode_steps
        o[1] += ns / 1e3 / decode_steps
    return dict(sorted(ops.items(), key=lambda kv: -kv[1][1]))


def scope_of(op_name: str) -> str:
    """``offload_fill``, ``self_attn/indexer``, ``mlp``, ``lm_head``, ... for a kernel's op_name."""
    for s in CACHE_SCOPES:
        if s in op_name:
            return s
    m = re.search(r"GLM5/layers_\d+/(\w+)(?:/(indexer)\b)?", op_name)
    if m:
        return "/".join(x for x in m.groups() if x)
    m = re.search(r"GLM5/(\w+)", op_name)
    if m:
        return m.group(1)
    if "gumbel" in op_name or "argmax" in op_name or "argsort" in op_name or "sample" in op_name:
        return "sample"
    return "other"


def device_events(path: str) -> list:
    """(name, start_ns, duration_ns, stats) of every event that ran an HLO op: the accelerator's stream events, or
    on a CPU-only run the host's XLA thunks (so the scripts can be tried on a laptop)."""
    from jax.profiler import ProfileData
    pd = ProfileData.from_file(path)
    planes = [p for p in pd.planes if p.name.startswith("/device:")] or [p for p in pd.planes
                                                                         if p.name.startswith("/host:CPU")]
    out = []
    for plane in planes:
        for line in plane.lines:
            for ev in line.events:
                stats = dict(ev.stats)
                if "hlo_module" in stats:
                    out.append((ev.name, ev.start_ns, ev.duration_ns, stats))
    return out


def host_events(path: str) -> list:
    """(plane, thread, name, start_ns, duration_ns) of every host event: the TraceMe annotations of JAX's dispatch,
    PJRT's execute and XLA's thunks, and, on GPUs, the CUDA driver calls the profiler records. Host and device
    timestamps share one clock, so a host event can be placed against the device's decode window."""
    from jax.profiler import ProfileData
    out = []
    for plane in ProfileData.from_file(path).planes:
        if not plane.name.startswith("/host:"):
            continue
        for line in plane.lines:
            for ev in line.events:
                out.append((plane.name, line.name, ev.name, ev.start_ns, ev.duration_ns))
    return out


def _host_key(name: str) -> str:
    """A host event's name without the per-call details TraceMe appends (``Thunk:#hlo_op=fusion.12#`` and the like
    would list every kernel apart; the sum over a kind of event is what tells where a step call's time goes)."""
    return re.sub(r"\d+", "N", name.split("#")[0].strip())[:80]


def host_time(events: list, t0: int, t1: int, steps: int, top: int = 30) -> dict:
    """Where the host's time went between ``t0`` and ``t1`` (ns, e.g. the device's decode window), per step: for
    each thread the busy time (outermost events), and per kind of event the inclusive and the self time (nested
    events subtracted) and the count. Events of one thread nest; the self time of the kinds sums to the busy time."""
    steps = max(steps, 1)
    by_thread = collections.defaultdict(list)
    for plane, thread, name, start, dur in events:
        if start >= t0 and start < t1:
            by_thread[(plane, thread)].append((start, dur, _host_key(name)))
    inclusive, self_time, count, busy = (collections.Counter() for _ in range(4))

    def close(stack, until):  # the open events that ended by ``until`` take their self time
        while stack and stack[-1][0] <= until:
            _, k, own = stack.pop()
            self_time[k] += own

    for key, evs in by_thread.items():
        evs.sort(key=lambda e: (e[0], -e[1]))
        stack = []  # [end, key, self ns] of the open events
        for start, dur, k in evs:
            close(stack, start)
            if stack:
                stack[-1][2] -= min(dur, stack[-1][0] - start)
            else:
                busy[f"{key[0]} {key[1]}"] += dur
            inclusive[k] += dur
            count[k] += 1
            stack.append([start + dur, k, dur])
        close(stack, float("inf"))
    per_step = lambda c: {k: round(v / 1e3 / steps, 2) for k, v in c.most_common(top)}
    return {"thread_busy_us_per_step": per_step(busy), "self_us_per_step": per_step(self_time),
            "inclusive_us_per_step": per_step(inclusive),
            "count_per_step": {k: round(count[k] / steps, 2) for k, _ in self_time.most_common(top)}}


def kernel_scope(name: str, hlo_op: str, module: str, op_names: dict) -> tuple[str, str]:
    """(scope, op_name) of one kernel event."""
    del module  # every decode kernel, copyback included, runs in the decode module
    for key, scope in KERNEL_SCOPES:
        if key in name:
            return scope, ""
    op_name = op_names.get(name) or op_names.get(hlo_op, "")
    return (scope_of(op_name) if op_name else "unattributed"), op_name


def kernel_op_name(name: str, hlo_op: str, op_names: dict) -> str:
    """The op_name of a kernel event: by its own name, else by its HLO instruction ("" if neither is known)."""
    return op_names.get(name) or op_names.get(hlo_op, "") or op_names.get(_kernel_key(hlo_op), "")


# ----------------------------------------------------------------------------------------------------------------
# Parts of the model (what a step's device time is spent on)
# ----------------------------------------------------------------------------------------------------------------
# The brief's split (indexer scores, top-k, attention gather, attention math, MoE, dense MLP, LM head, other), with
# the few buckets that would otherwise swamp "other" named on their own: the attention's weight matmuls
# (attention_projections: q_a / q_b / kv_a / o_proj and the indexer's wq_b / wk / weights_proj), the cache's writes
# and bookkeeping (cache_write), the MTP layer's rows (mtp), and kernels with no metadata at all (unattributed).
PARTS = ("indexer_scores", "topk", "attention_gather", "attention_math", "attention_projections", "moe", "dense_mlp",
         "lm_head", "cache_write", "mtp", "norms_residual", "other", "unattributed")

_ATTN_PROJ = re.compile(r"self_attn/(?:indexer/)?(q_a_proj|q_b_proj|kv_a_proj_with_mqa|o_proj|wq_b|wk|weights_proj)/")
# Absorbed MLA: kv_b_proj applied per token to the query (q_nope -> latent) and the output (latent -> v heads):
# weight matmuls too (glm53.model.MLAttention's einsums).
_ABSORBED = ("bthd,chd->bthc", "bthc,chv->bthv")
_DENSE_MLP = re.compile(r"/mlp/(gate_proj|up_proj|down_proj)/")
_LAYER = re.compile(r"GLM5/layers_(\d+)/")


def part_of(name: str, op_name: str, *, first_moe_layer: int | None = None) -> str:
    """The part of the model a kernel does (one of ``PARTS``), from its event name and its op_name.

    ``first_moe_layer`` (the config's ``first_k_dense_replace``): MLP kernels whose op_name names a layer below it
    are the dense MLP's; without a layer in the op_name (XLA shares a fusion between layers) an MLP kernel is the
    MoE's unless it is one of the dense MLP's own matmuls (``mlp/gate_proj`` etc.; the shared expert's are
    ``mlp/shared_experts/...``)."""
    o = op_name or ""
    if o.startswith("params["):  # a layout copy of a parameter: params['layers_1']['mlp']['experts_up_proj']
        o = "GLM5/" + "/".join(re.findall(r"'(\w+)'", o.replace("\\'", "'"))) + "/"
        if "experts" in o:
            return "moe"
    # The cache's scopes first: a Pallas copy is a bulk read of the history or a copyback only by its op_name.
    if "offload_bulk_read" in o or "offload_gather" in o or "resident_gather" in o or "offload_classify" in o:
        return "attention_gather"
    if any(s in o for s in ("offload_copyback", "offload_ring_write", "resident_write", "offload_fill")):
        return "cache_write"
    # Pallas kernels by name (their op_name may be unknown inside a command buffer).
    if "indexer_scores" in name:
        return "indexer_scores"
    if "topk" in name:
        return "topk"
    if "gather_rows" in name or "hot_gather" in name or "copy_blocks" in name:
        # copy_blocks without an op_name: in a prefill chunk most of its time is the bulk read of the history
        return "attention_gather"
    if "fill_round" in name or "fill_rows" in name:
        return "cache_write"
    if "grouped_matmul" in name or "ragged" in name:  # the MoE experts' grouped matmul kernel (or XLA's ragged dot)
        return "moe"
    if not o:
        return "unattributed"
    if "mtp_layer" in o or "mtp_kv" in o:
        return "mtp"
    if "lm_head" in o or "GLM5.logits" in o or "/logits/" in o:
        return "lm_head"
    if "/indexer/" in o:
        if "topk_positions" in o or "top_k" in o or "/sort" in o:
            return "topk"
        if _ATTN_PROJ.search(o):
            return "attention_projections"
        if "write_index_keys" in o or "index_keys" in o:
            return "cache_write"
        return "indexer_scores"
    if "/self_attn/" in o:
        if _ATTN_PROJ.search(o) or any(e in o for e in _ABSORBED):
            return "attention_projections"
        if "layernorm" in o:
            return "norms_residual"
        return "attention_math"
    if "/mlp/" in o:
        if "shared_experts" in o or "ragged" in o:
            return "moe"
        if _DENSE_MLP.search(o):
            return "dense_mlp"
        m = _LAYER.search(o)
        if m and first_moe_layer is not None:
            return "dense_mlp" if int(m.group(1)) < first_moe_layer else "moe"
        return "moe"
    if "layernorm" in o or "/norm/" in o or re.search(r"GLM5/layers_\d+/add", o) or "GLM5/norm" in o:
        return "norms_residual"
    return "other"


def compiled_decode_hlo(model, engine, lanes, bucket: int, selection, copy_pages: int) -> str:
    """The compiled HLO text of an engine's plain decode step for ``bucket`` lanes (greedy, as the benchmarks run
    it; ``selection``: the override array or None; ``copy_pages``: 0 for the variant without the copyback), from
    arguments shaped like a decode call's. Nothing runs and nothing is donated (``Steps.lower``)."""
    i32 = jnp.zeros((bucket,), jnp.int32)
    return model.steps.lower("decode", model.params, engine.cache, lanes, i32, jnp.ones((bucket,), jnp.int32),
                             jnp.int32(0), jnp.float32(0), jnp.float32(1), engine._stop_ids(None), selection,
                             greedy=True, kernels=engine.kernels, copy_pages=copy_pages).compile().as_text()


def copied_cache_params(hlo_text: str) -> list:
    """The cache parameters a compiled step copies (its parameters are named ``cache_...`` after the pytree):
    ``experiments.step_copies`` and ``tests/test_step_copies.py``. Here, not in the entry point, so tests import it
    without the entry point's absl flags."""
    return sorted(set(re.findall(r"copy\(%(cache_[\w.\-]+)\)", hlo_text)))
