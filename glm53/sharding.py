"""Meshes and the layout of parameters and caches on them: one table of logical axes per parameter, one table of
rules mapping logical axes to mesh axes (MaxText's rules style), so a layout is decided in one place.

    mesh = glm53.sharding.make_mesh(glm53.sharding.MeshConfig(tp=4))   # None for one device: nothing changes
    model = glm53.sharding.shard_model(model, mesh)                    # parameters placed by the rules
    engine = glm53.Engine(model, ...)                                  # the cache follows model.mesh

**Tensor parallelism (``tp``)** is GSPMD's: parameters carry ``NamedSharding``s over the ``tp`` mesh axis (attention
heads, indexer heads, dense and expert MLP widths, the vocabulary) and the jitted steps are partitioned by XLA, which
inserts the collectives. Split reductions (``o_proj``, ``down_proj``, the LM head's vocabulary) sum in another order
than one device does: tokens stay identical, float32 logits agree to ~1e-6 relative, not bit for bit.

**No expert axis, by choice.** Routed experts are split by width (``expert_mlp`` over ``tp``), not placed whole on
devices (expert parallelism). Decode reads weights, and a step of a few sessions routes its tokens to a few dozen of
GLM-5's 256 experts: split by width, every device reads an equal 1/tp of each routed expert; placed whole, the
devices holding the popular experts read all of theirs while others idle, and the step waits for the busiest
(tokens would also have to travel to their experts' devices). Expert parallelism pays in large prefill batches,
where each expert's matmul grows; that trade is not made here.

**The cache is replicated over ``tp``.** MLA's latent row is shared by every head, so each device of a
tensor-parallel group holds the same rows: the row is packed once (in the step, from replicated inputs) and the
replicas are the same bytes (the article: quantising on each side cost speed and lost overlap). Sessions' tables,
indexer keys, the hot caches and the history are all replicated; in offload mode so is the host pool, one copy per
device in its host's memory (``Engine.memory_report()["host"]["pool_replicas"]``; ``glm53.memory.plan`` counts
them). One copy per host shared by its devices (the article's owner and peer) is not built yet.

**Pipeline stages (``stages``)** are ``glm53.pipeline``'s: each stage is a ``(1, tp)`` sub-mesh holding a run of
layers (weights split over its ``tp`` devices by the rules here) and their cache, running its own programs;
activations pass from stage to stage. Stage-only layouts are bit-identical to one device.

**Pallas kernels on a mesh.** A Pallas call reaches XLA as a custom call with no partitioning rule, whose operands
GSPMD replicates. Where that matters, the model splits the work itself: the MoE's grouped matmul runs under
``jax.shard_map`` on each device's slice of the experts' width (``expert_mlp`` over ``tp``) and the partial outputs
are summed (``glm53.model.MoE``; FP8 experts too, each device taking its slice's whole 128-wide scale blocks,
where the slice holds whole blocks: GLM-5's 2,048-wide experts on up to 16 devices). The other kernels take
replicated operands (the cache, gathered rows) and run whole on every device, as the replicated cache intends; the
indexer kernel's head-split queries and weights should reach it gathered (small: ``[B, T, heads, 128]``), every
device scoring every head: expected of a GPU's compiled custom call, not checked there (the CPU's interpreted
kernels are ordinary HLO that GSPMD partitions like the rest).

**Several processes** (``glm53.distributed``, ``experiments.launch``): the mesh spans the devices of every process;
each process runs the same steps on the same inputs (SPMD), so the code above is unchanged.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from glm53.config import ConfigError

MESH_AXES = ("stage", "tp")

# Logical axis -> mesh axis. A logical axis not listed (or mapped to None) is replicated.
RULES: dict[str, str | None] = {
    "vocab": "tp",
    "heads": "tp",  # MLA query / value heads (q_b_proj's and kv_b_proj's outputs, o_proj's input)
    "index_heads": "tp",  # DSA indexer heads (wq_b's output, weights_proj's output)
    "mlp": "tp",  # dense SwiGLU width and the shared experts'
    "expert_mlp": "tp",  # each routed expert's SwiGLU width
    "embed": None,  # the residual stream stays whole on every device
    "q_lora": None,
    "kv_lora": None,  # the latent row every head reads: replicated (see the module docstring)
    "experts": None,
    "norm": None,
}

# Parameter path (joined with "/", layer indices as written) -> logical axes of its dimensions, first match wins.
# Anything unmatched is replicated: a new parameter is never split by accident.
PARAM_AXES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    (r"(^|/)embed_tokens$", ("vocab", "embed")),
    (r"(^|/)lm_head$", ("embed", "vocab")),
    (r"self_attn/q_b_proj/kernel$", ("q_lora", "heads")),
    (r"self_attn/kv_b_proj$", ("kv_lora", "heads")),
    (r"self_attn/o_proj/kernel$", ("heads", "embed")),
    (r"indexer/wq_b/kernel$", ("q_lora", "index_heads")),
    (r"indexer/weights_proj$", ("embed", "index_heads")),
    (r"mlp/(shared_experts/)?(gate_proj|up_proj)/kernel$", ("embed", "mlp")),
    (r"mlp/(shared_experts/)?down_proj/kernel$", ("mlp", "embed")),
    (r"mlp/experts_(gate_proj|up_proj)$", ("experts", "embed", "expert_mlp")),
    (r"mlp/experts_down_proj$", ("experts", "expert_mlp", "embed")),
)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """``stages x tp`` devices. ``MeshConfig()`` is one device: no mesh at all. ``microbatches``: with stages,
    how many equal groups of sessions a decode step splits into so stages work at once (``glm53.pipeline``; it must
    divide an engine's ``max_sessions``; 1 keeps every program's batch whole, which is what makes stages
    bit-identical to one device)."""

    stages: int = 1
    tp: int = 1
    microbatches: int = 1

    def __post_init__(self):
        for name in ("stages", "tp", "microbatches"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ConfigError(f"mesh.{name} must be an int >= 1, got {v!r}")
        if self.microbatches > 1 and self.stages == 1:
            raise ConfigError(f"mesh.microbatches={self.microbatches} splits a decode step between pipeline stages; "
                              "it needs mesh.stages > 1")

    @property
    def devices(self) -> int:
        return self.stages * self.tp

    @classmethod
    def from_config_dict(cls, d: Mapping[str, Any] | None) -> "MeshConfig":
        d = dict(d or {})
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ConfigError(f"unknown mesh settings {sorted(unknown)}; known: stages, tp, microbatches")
        return cls(**d)


def make_mesh(mc: MeshConfig | Mapping[str, Any] | None, devices=None) -> Mesh | None:
    """The ``(stage, tp)`` mesh of ``mc`` over the first ``stages * tp`` devices (``devices`` or ``jax.devices()``);
    None for one device, so the single-device path is exactly the one without a mesh."""
    mc = mc if isinstance(mc, MeshConfig) else MeshConfig.from_config_dict(mc)
    if mc.devices == 1:
        return None
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) < mc.devices:
        raise ConfigError(f"mesh {mc.stages} x {mc.tp} needs {mc.devices} devices, {len(devices)} are visible (on a "
                          "CPU: XLA_FLAGS=--xla_force_host_platform_device_count=N)")
    if jax.process_count() > 1 and mc.devices != len(devices):
        # Every process runs every step: a mesh leaving some process's devices out would leave it nothing to run.
        raise ConfigError(f"mesh {mc.stages} x {mc.tp} over {jax.process_count()} processes must span every device "
                          f"({len(devices)} visible)")
    grid = np.array(devices[: mc.devices], dtype=object).reshape(mc.stages, mc.tp)
    return Mesh(grid, MESH_AXES)


def logical_axes(path: str, ndim: int) -> tuple[str | None, ...]:
    """The logical axes of the parameter at ``path`` ("layers_3/self_attn/o_proj/kernel")."""
    for pattern, axes in PARAM_AXES:
        if re.search(pattern, path):
            if len(axes) != ndim:
                raise ValueError(f"parameter {path}: the layout table names {len(axes)} axes, it has {ndim}")
            return axes
    return (None,) * ndim


def spec_of(axes: tuple[str | None, ...], shape: tuple[int, ...], mesh_shape: Mapping[str, int],
            path: str = "") -> P:
    """The PartitionSpec of logical ``axes`` under ``RULES`` on a mesh of ``mesh_shape`` ({axis: size}: a
    ``Mesh.shape``, or sizes alone for planning); a dimension the mesh axis does not divide is an error (GSPMD
    would pad it: uneven shards that no layout here intends)."""
    out = []
    for axis, size in zip(axes, shape):
        mesh_axis = RULES.get(axis) if axis else None
        n = mesh_shape.get(mesh_axis, 1) if mesh_axis is not None else 1
        if n > 1:
            if size % n:
                raise ConfigError(f"parameter {path}: its {axis} dimension ({size}) is not divisible by mesh axis "
                                  f"{mesh_axis}={n}")
            out.append(mesh_axis)
        else:
            out.append(None)
    return P(*out)


def shard_bytes(params, mesh_shape: Mapping[str, int]) -> int:
    """Bytes of one device's shards of ``params`` (arrays or ShapeDtypeStructs) under the rules, on a mesh of
    ``mesh_shape``: what ``shard_model`` would put on each device, computed without devices (the planner)."""
    total = 0
    for keys, leaf in jax.tree_util.tree_leaves_with_path(params):
        path = _path(keys)
        spec = spec_of(logical_axes(path, len(leaf.shape)), tuple(leaf.shape), mesh_shape, path)
        elements = 1
        for size, axis in zip(leaf.shape, tuple(spec) + (None,) * (len(leaf.shape) - len(spec))):
            elements *= size // (mesh_shape[axis] if axis else 1)
        total += elements * np.dtype(leaf.dtype).itemsize
    return total


def key_names(keys) -> list[str]:
    """The names of a ``jax.tree_util`` key path (``DictKey("layers_3")`` -> "layers_3")."""
    return [str(getattr(k, "key", getattr(k, "name", k))) for k in keys]


def _path(keys) -> str:
    return "/".join(key_names(keys))


def param_shardings(params, mesh: Mesh):
    """``NamedSharding`` of every parameter under ``PARAM_AXES`` and ``RULES``."""
    return jax.tree_util.tree_map_with_path(lambda keys, leaf: leaf_sharding(_path(keys), leaf.shape, mesh), params)


def leaf_sharding(path: str, shape: tuple[int, ...], mesh: Mesh) -> NamedSharding:
    """The ``NamedSharding`` of the parameter at ``path`` ("layers_3/self_attn/o_proj/kernel") of ``shape``."""
    return NamedSharding(mesh, spec_of(logical_axes(path, len(shape)), tuple(shape), mesh.shape, path))


def resolve_mesh(mesh: Mesh | MeshConfig | Mapping[str, Any] | None) -> tuple[Mesh | None, int]:
    """``(mesh, microbatches)``: a ``MeshConfig`` / dict made into its mesh (None for one device), a ``Mesh`` as it
    is with one microbatch."""
    if mesh is None or isinstance(mesh, Mesh):
        return mesh, 1
    mc = mesh if isinstance(mesh, MeshConfig) else MeshConfig.from_config_dict(mesh)
    return make_mesh(mc), mc.microbatches


class Placement:
    """Where each weight of a model goes on ``mesh``, decided from the config's parameter shapes before any weight
    exists, so the constructors put each one there as soon as it is drawn or read (``placement(path, array)``) and
    orbax restores each straight there (``restore_target``): no device ever holds more than its share of the model
    and the weight being made. GLM-5 in FP8 (~750 GB) could not otherwise load onto a mesh of H200s (141 GB each):
    the whole model went to one device first.

    Without pipeline stages a weight goes to its shards over the whole mesh by the rules. With stages the split of
    layers is the pipeline's (``glm53.pipeline.Pipeline``, built here from the shapes, then the model's): a weight
    goes to its stage's devices, split over that stage's ``tp``, and the embedding also to the last stage where its
    MTP layer or tied head reads it. ``dtype``: the model's (with stages the split follows the bytes in it)."""

    def __init__(self, cfg, dtype, expert_weights: str, mesh: Mesh, microbatches: int = 1):
        self.mesh = mesh
        self.pipeline = None
        if mesh.shape["stage"] > 1:
            from glm53 import pipeline  # pipeline imports the steps, which import the model
            from glm53.params import param_shapes

            self.pipeline = pipeline.Pipeline(cfg, dtype, mesh, param_shapes(cfg, dtype, expert_weights),
                                              microbatches=microbatches)

    def __call__(self, path: tuple[str, ...], array):
        """One weight (``path`` its keys) put onto its devices."""
        if self.pipeline is not None:
            return self.pipeline.place_leaf(tuple(path), array)
        return jax.device_put(array, leaf_sharding("/".join(path), array.shape, self.mesh))

    def restore_target(self, shapes):
        """``shapes`` (``ShapeDtypeStruct``s) carrying the shardings orbax restores each parameter onto."""
        def one(keys, s):
            path = tuple(key_names(keys))
            where = (self.pipeline.restore_sharding(path, s.shape) if self.pipeline is not None
                     else leaf_sharding("/".join(path), s.shape, self.mesh))
            return jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=where)
        return jax.tree_util.tree_map_with_path(one, shapes)

    def restored(self, params):
        """``params`` as orbax restored them onto ``restore_target``, ready to be the model's."""
        return params if self.pipeline is None else self.pipeline.restored(params)

    def cast(self, params, shapes):
        """``params`` in the dtypes of ``shapes``, each cast where it lies."""
        if self.pipeline is not None:
            return self.pipeline.cast(params, shapes)
        return jax.tree_util.tree_map(lambda p, s: p.astype(s.dtype), params, shapes)

    def params_digest(self, params) -> str:
        """``glm53.checkpoint.params_digest`` of the placed ``params``, the same in every process."""
        from glm53 import checkpoint

        if self.pipeline is not None:
            return self.pipeline.params_digest(params)
        return checkpoint.params_digest(params)


def placement(cfg, dtype, expert_weights: str, mesh: Mesh | None, microbatches: int = 1) -> Placement | None:
    """The ``Placement`` of a model's weights on ``mesh``; None without one (the weights stay where they are made)."""
    return None if mesh is None else Placement(cfg, dtype, expert_weights, mesh, microbatches)


def check_model(cfg, mesh: Mesh) -> None:
    """Head counts a ``tp`` split must divide (a width divisible by tp but not on a head boundary would split a
    head across devices), and a main layer for every pipeline stage."""
    check_shape(cfg, mesh.shape["stage"], mesh.shape["tp"])


def check_shape(cfg, stages: int, tp: int) -> None:
    """``check_model`` on mesh sizes alone (the planner's ``mesh_shape``: no devices)."""
    for name in ("num_attention_heads", "index_n_heads"):
        n = getattr(cfg, name)
        if n % tp:
            raise ConfigError(f"mesh.tp={tp} does not divide {name}={n}")
    check_stages(cfg, stages)


def check_stages(cfg, stages: int) -> None:
    if stages > cfg.num_hidden_layers:
        raise ConfigError(f"mesh.stages={stages} is more than the model's {cfg.num_hidden_layers} layers (each stage "
                          "needs one)")


def check_layout(cfg, mesh: Mesh | MeshConfig | Mapping[str, Any] | None) -> None:
    """``mesh`` (as ``shard_model`` takes it) against the model's config alone: enough devices, tp dividing the
    heads, a layer per stage. The model constructors call it before they read or initialise any weight, so a layout
    that cannot work is refused at once, not after minutes of loading a large model."""
    if mesh is not None and not isinstance(mesh, Mesh):
        mesh = make_mesh(mesh if isinstance(mesh, MeshConfig) else MeshConfig.from_config_dict(mesh))
    if mesh is not None:
        check_model(cfg, mesh)


def shard_model(model, mesh: Mesh | MeshConfig | Mapping[str, Any] | None, microbatches: int | None = None, *,
                placed: Placement | None = None):
    """``model`` with its parameters placed on ``mesh`` by the rules (``model.mesh`` set; engines built on it put
    their cache there). A ``MeshConfig`` / dict is made into a mesh first; None or one device returns the model
    unchanged. ``microbatches``: for a ``Mesh`` with stages (a ``MeshConfig`` carries its own). ``placed``: the
    ``Placement`` the constructors put the parameters on its mesh with, as they were made or read (nothing moves)."""
    if placed is not None:
        mesh = placed.mesh
    else:
        mesh, own = resolve_mesh(mesh)
        microbatches = microbatches or own
        if mesh is None:
            return model
        check_model(model.config, mesh)
        placed = Placement(model.config, model.dtype, model.expert_weights, mesh, microbatches)
        if placed.pipeline is not None:
            model.params = placed.pipeline.place(model.params)
        else:
            model.params = jax.device_put(model.params, param_shardings(model.params, mesh))
    pipe = placed.pipeline
    if pipe is not None:
        from glm53 import pipeline  # pipeline imports the steps, which import the model

        if pipe.cfg != model.config:
            raise ValueError("the weights were placed for another model config than the model's")

        model.params = pipe.take(model.params)
        model.steps = pipeline.PipelineSteps(pipe, model.module)
        model.pipeline = pipe
        # Now, once: with several processes a stage's weights lie in one process (Model.params_digest's own
        # reading of every tensor needs them all in each); sessions' saves carry the digest. Known already when
        # the weights were loaded from a save that recorded it.
        if not model.has_params_digest:
            model.set_params_digest(placed.params_digest(model.params))
    model.mesh = mesh
    return model


def replicated(mesh: Mesh, memory_kind: str = "device") -> NamedSharding:
    return NamedSharding(mesh, P(), memory_kind=memory_kind)


def describe(params) -> str:
    """Each parameter's PartitionSpec, one line per distinct (path with layer indices folded, spec)."""
    seen, lines = set(), []
    for keys, leaf in jax.tree_util.tree_leaves_with_path(params):
        path = re.sub(r"layers_\d+", "layers_*", _path(keys))
        spec = getattr(leaf.sharding, "spec", None)
        if (path, str(spec)) not in seen:
            seen.add((path, str(spec)))
            lines.append(f"  {path:<60} {str(tuple(leaf.shape)):<22} {spec}")
    return "\n".join(lines)
