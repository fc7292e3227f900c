"""Pipeline stages: each stage of the ``(stage, tp)`` mesh owns a contiguous run of layers, their weights and their
cache (device rows, indexer keys, and in offload mode their part of the host pool), and runs them as its own jitted
programs on its own devices; activations pass from stage to stage.

    model = glm53.from_config(cfg, mesh=glm53.MeshConfig(stages=4, tp=2))   # 4 stages of 2 tensor-parallel devices
    engine = glm53.Engine(model, ...)                                        # the same engine, its cache staged

**Why separate programs (MPMD), not one SPMD program.** GLM-5's layers are of several kinds (dense or MoE, own or
shared indexer, the MTP layer), separate Flax modules rather than one stack a ``layers`` mesh axis could split; an
SPMD program over the whole mesh would have to hold every layer's weights on every device or stack unlike layers.
Here a stage is a sub-mesh ``(1, tp)`` of the mesh: its weights carry the same ``glm53.sharding`` rules over its
``tp`` devices, and its programs are the engine's steps restricted to its layers. JAX dispatches them
asynchronously, so with ``MeshConfig.microbatches = M`` (decode splits its lanes into M groups, issued in turn)
stage ``s`` works on one group while stage ``s + 1`` works on the one before.

**The cache is staged by layer** (``StagedCache``): stage ``s`` holds the cache of its layers only, numbered from its
first (``DecoderLayer.cache_layer``), built by the ordinary cache constructors on a view of the config that holds
those layers (``StageConfig``). Every stage keeps the same session table (lengths, MTP lengths; the commits of a
step are known to every stage, or sent back from the last one after an MTP verify), and in offload mode the same
page table: page ``p`` of stage ``s``'s pool holds page ``p``'s rows of that stage's layers, so the engine's page
allocator is unchanged and each stage's history lives in the host memory of that stage's devices.

**Placement.** The embedding is on the first stage; the final norm, the LM head and the MTP layer on the last, which
also holds a copy of the embedding where the MTP layer or a tied head reads it. Layers are split where the stages'
parameter bytes are most even (``split_layers``), decided from the parameters' shapes, so the model's constructors
put each weight on its stage as soon as it is drawn or read (``Pipeline.place_leaf``), and orbax restores each
there (``restore_sharding``): no device ever holds the whole model (GLM-5 in FP8 is 720 GiB; a stage of 8 on
H200s holds at most 94 GiB of it).

**Bit-identical to one device** for stage-only layouts (``tp = 1``) with whole batches (``microbatches = 1``): every
stage runs exactly the operations the whole model runs on its layers, in the same order, on the same bytes.

**Several processes** (``glm53.distributed``): each stage lies in one process, which alone runs its programs; an
activation crossing to another process's stage goes by a collective-permute over the two stages' devices, and what
every process's engine reads (a step's outputs, counters, a save's rows) by a collective over the whole mesh. As
with tensor parallelism every process makes the same engine calls in the same order.

**Selection traces** (``glm53.trace``): each stage's program returns its rounds as a trace records them, numbered in
its cache; ``PipelineSteps`` renumbers them into the model's layers and pads them to the step's widest round, so a
trace recorded on stages is the one a single device records. With several processes each stage's trace is sent to
every process (every engine records, as every engine makes the same calls).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from glm53 import memory, sharding
from glm53.cache import Lanes, init_resident
from glm53.config import CacheConfig, ConfigError, ModelConfig
from glm53.model import F32, DecoderLayer, MTPModule, RMSNorm, head_logits
from glm53.offload import trace_rounds
from glm53.steps import Steps, chunk_context, decode_context, verify_context

Array = jax.Array


# ----------------------------------------------------------------------------------------------------------------
# Which layers each stage holds
# ----------------------------------------------------------------------------------------------------------------
def split_layers(cfg: ModelConfig, stages: int, layer_bytes, first_extra: int = 0, last_extra: int = 0
                 ) -> tuple[tuple[int, ...], ...]:
    """Cache layers of each stage: contiguous runs of main layers, at least one per stage, cut where the largest
    stage's parameter bytes (``layer_bytes[l]`` for main layer l, plus ``first_extra`` on the first stage and
    ``last_extra`` on the last) is smallest; the MTP layer goes with the last stage (it reads the last layer's
    hidden state and the LM head)."""
    L = cfg.num_hidden_layers
    sharding.check_stages(cfg, stages)
    w = np.asarray(layer_bytes, np.int64)
    prefix = np.concatenate([[0], np.cumsum(w)])
    INF = np.iinfo(np.int64).max

    def cost(s, i, j):  # stage s holds main layers [i, j)
        return int(prefix[j] - prefix[i]) + (first_extra if s == 0 else 0) + (last_extra if s == stages - 1 else 0)

    # best[s][j]: the smallest largest-stage cost of stages 0..s holding layers [0, j); cut[s][j] the start of s.
    best = np.full((stages, L + 1), INF, np.int64)
    cut = np.zeros((stages, L + 1), np.int64)
    for j in range(1, L + 1):
        best[0, j] = cost(0, 0, j)
    for s in range(1, stages):
        for j in range(s + 1, L + 1):
            for i in range(s, j):
                c = max(best[s - 1, i], cost(s, i, j))
                if c < best[s, j]:
                    best[s, j], cut[s, j] = c, i
    bounds, j = [L], L
    for s in range(stages - 1, 0, -1):
        j = int(cut[s, j])
        bounds.append(j)
    bounds = [0] + bounds[::-1]
    out = [tuple(range(bounds[s], bounds[s + 1])) for s in range(stages)]
    out[-1] = out[-1] + tuple(range(L, cfg.num_cache_layers))  # the MTP layer(s)
    return tuple(out)


def _tree_bytes(tree) -> int:
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(tree))


def needs_embed_copy(cfg: ModelConfig, stages: int) -> bool:
    """Whether the last stage holds a copy of the embedding (its MTP layer or a tied LM head reads it)."""
    return stages > 1 and bool(cfg.num_nextn_predict_layers or cfg.tie_word_embeddings)


def stage_layers(cfg: ModelConfig, stages: int, params) -> tuple[tuple[int, ...], ...]:
    """``split_layers`` by the bytes of ``params`` (arrays, or ``ShapeDtypeStruct``s for a plan): what each of
    ``stages`` stages holds, the first with the embedding, the last with the head, the MTP layer and (where read
    there) a copy of the embedding."""
    sizes = {k: _tree_bytes(v) for k, v in params.items()}
    head = sizes.get("lm_head", 0) + sizes.get("norm", 0) + sizes.get("mtp_layer", 0)
    if needs_embed_copy(cfg, stages):
        head += sizes["embed_tokens"]
    return split_layers(cfg, stages, [sizes[f"layers_{l}"] for l in range(cfg.num_hidden_layers)],
                        sizes["embed_tokens"], head)


def owner(path: str, stage_of_layer: dict, stages: int) -> int:
    """The stage holding the parameter at ``path`` ("layers_3/mlp/...", "embed_tokens", "lm_head", ...)."""
    head = path.split("/", 1)[0]
    if head.startswith("layers_"):
        return stage_of_layer[int(head[len("layers_"):])]
    return 0 if head == "embed_tokens" else stages - 1


def stage_param_trees(cfg: ModelConfig, layers: tuple, params) -> list[dict]:
    """Each stage's top-level parameter entries (the last's with the embedding, where it needs a copy); the
    entries are ``params``' own (a copy is placed by ``Pipeline.stage_params``)."""
    stage_of_layer = {l: s for s, ls in enumerate(layers) for l in ls}
    parts = [{} for _ in layers]
    for k, v in params.items():
        parts[owner(k, stage_of_layer, len(layers))][k] = v
    if needs_embed_copy(cfg, len(layers)):
        parts[-1]["embed_tokens"] = params["embed_tokens"]
    return parts


class StageConfig:
    """A view of a ``ModelConfig`` for building one stage's cache: it holds the cache layers ``layers`` (global
    numbers), numbered from 0. Everything else is the model's (sessions keep the model's MTP lag on every stage)."""

    def __init__(self, cfg: ModelConfig, layers: tuple[int, ...]):
        self._cfg, self.layers = cfg, tuple(layers)

    def __getattr__(self, name):
        return getattr(self._cfg, name)

    @property
    def num_cache_layers(self) -> int:
        return len(self.layers)

    @property
    def full_indexer_layers(self) -> tuple[int, ...]:
        return tuple(i for i, l in enumerate(self.layers) if self._cfg.layer_indexer_type(l) == "full")

    @property
    def cache_holds_mtp_layer(self) -> bool:
        return self._cfg.num_hidden_layers in self.layers


# ----------------------------------------------------------------------------------------------------------------
# The staged cache
# ----------------------------------------------------------------------------------------------------------------
@flax.struct.dataclass
class StagedCache:
    """One cache per stage, each on its stage's devices (with several processes, a stage on another process's
    devices is a global array this process holds no part of). Reads the engine makes of a cache (counters, page
    bookkeeping) are answered for the whole model: per-layer arrays stacked in layer order (each stage's sent to
    every process), per-slot ones from a stage of this process (every stage holds the same)."""

    parts: tuple
    pipeline: Any = flax.struct.field(pytree_node=False, default=None)

    @property
    def mode(self) -> str:
        return self.parts[0].mode

    # Per-layer arrays the engine reads (counters) and a selection trace snapshots (glm53.trace.SNAPSHOT_FIELDS):
    # every stage's, stacked in layer order.
    PER_LAYER = frozenset({"counters", "bulk_pages", "position_of_slot", "pin_round", "rounds", "clock"})

    def __getattr__(self, name):
        # kv_format, num_slots, capacity, fmt, page_rows, copybacks, unassigned, policy ...: the same on every
        # stage; read from one this process holds.
        if name.startswith("__") or name in ("parts", "pipeline"):
            raise AttributeError(name)
        if name in StagedCache.PER_LAYER:
            return np.concatenate([self.pipeline.to_host(getattr(p, name), s) for s, p in enumerate(self.parts)])
        return getattr(self.parts[self.pipeline.first_local], name)

    @property
    def num_layers(self) -> int:
        return sum(p.num_layers for p in self.parts)

    @property
    def policy_state(self) -> dict:
        return {n: np.concatenate([self.pipeline.to_host(p.policy_state[n], s) for s, p in enumerate(self.parts)])
                for n in self.parts[self.pipeline.first_local].policy_state}

    def outputs_placement(self) -> NamedSharding:
        """Where outputs the host reads (tokens, logits) are: the last stage's devices, or with several processes
        every device of the mesh (sent there from the last stage)."""
        return self.pipeline.outputs_placement

    def nbytes(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for p in self.parts:
            for k, v in p.nbytes().items():
                out[k] = out.get(k, 0) + v
        return out


# ----------------------------------------------------------------------------------------------------------------
# One stage's layers
# ----------------------------------------------------------------------------------------------------------------
class Stage:
    """Stage ``index`` of ``count``: the modules of its cache layers (``layers``, global numbers), each told its
    index in the stage's cache."""

    def __init__(self, cfg: ModelConfig, dtype, index: int, count: int, layers: tuple[int, ...], mesh: Mesh):
        self.cfg, self.dtype, self.index, self.layers, self.mesh = cfg, dtype, index, tuple(layers), mesh
        self.first, self.last = index == 0, index == count - 1
        L = cfg.num_hidden_layers
        self.blocks = tuple((l, DecoderLayer(cfg, l, dtype, cache_layer=i)) for i, l in enumerate(layers) if l < L)
        self.mtp_block = MTPModule(cfg, L, dtype, cache_layer=self.layers.index(L)) if L in self.layers else None
        self.config = StageConfig(cfg, self.layers)
        self.replicated = NamedSharding(mesh, P())

    def run(self, params, x, topk, step, cache):
        """This stage's main layers: (x, topk of the last own-indexer layer, cache, rounds)."""
        rounds = []
        for l, block in self.blocks:
            x, cache, topk, round_ = block.apply({"params": params[f"layers_{l}"]}, x, step, cache, topk)
            rounds.append(round_)
        return x, topk, cache, rounds

    def input(self, params, tokens, carry):
        if carry is None:
            return jnp.take(params["embed_tokens"], tokens, axis=0), None
        return carry


class LastStage:
    """The steps' model interface (``glm53.steps.WholeModel``) for the last stage: ``forward`` takes the activation
    the stage before sent (``params["carry"]``) instead of embedding tokens; the head and the MTP layer are its."""

    def __init__(self, stage: Stage):
        self.stage, self.cfg, self.dtype = stage, stage.cfg, stage.dtype

    def forward(self, params, tokens, step, cache):
        x, topk = params["carry"]
        x, _, cache, rounds = self.stage.run(params, x, topk, step, cache)
        norm = RMSNorm(self.cfg.hidden_size, self.cfg.rms_norm_eps, self.dtype)
        return norm.apply({"params": params["norm"]}, x), cache, rounds

    def logits(self, params, hidden):
        return head_logits(hidden, params, self.cfg, self.dtype)

    def mtp(self, params, hidden, next_tokens, step, cache):
        emb = jnp.take(params["embed_tokens"], next_tokens, axis=0)
        return self.stage.mtp_block.apply({"params": params["mtp_layer"]}, emb, hidden, step, cache)

    def mtp_kv(self, params, hidden, next_tokens, step, cache):
        emb = jnp.take(params["embed_tokens"], next_tokens, axis=0)
        return self.stage.mtp_block.apply({"params": params["mtp_layer"]}, emb, hidden, step, cache,
                                          method=MTPModule.write_kv)


# ---- the programs of every stage but the last (the last runs glm53.steps' own, through LastStage) ----
def _commit(stage: Stage, cache, step, start, n):
    """The session-table update every stage makes (``CacheBase.advance``); the hidden state is the last stage's."""
    mtp_end = start - 1 + n if stage.cfg.num_nextn_predict_layers else None
    return cache.advance(step, n, jnp.zeros((n.shape[0], stage.cfg.hidden_size), F32), mtp_end)


def stage_chunk(stage: Stage, params, cache, lanes: Lanes, tokens, carry, n_valid, *, kernels: str, bulk: bool,
                copy_pages: int):
    lanes, start, step = chunk_context(stage, cache, lanes, n_valid, tokens.shape[1], kernels=kernels, bulk=bulk,
                                       copy_pages=copy_pages)
    cache = cache.begin_step(step)
    x, topk, cache, rounds = stage.run(params, *stage.input(params, tokens, carry), step, cache)
    cache = cache.finish_step(rounds, step)
    return _commit(stage, cache, step, start, n_valid), (x, topk)


def stage_decode(stage: Stage, params, cache, lanes: Lanes, tokens, carry, remaining, selection=None, *,
                 kernels: str, copy_pages: int, trace: bool = False):
    """With ``trace``: ((x, topk), this stage's rounds as a trace records them, layers numbered in its cache)."""
    lanes, n, start, step = decode_context(stage, cache, lanes, remaining, selection, kernels=kernels,
                                           copy_pages=copy_pages)
    cache = cache.begin_step(step)
    x, topk, cache, rounds = stage.run(params, *stage.input(params, tokens[:, None], carry), step, cache)
    cache = cache.finish_step(rounds, step)
    cache = _commit(stage, cache, step, start, n)
    return cache, (((x, topk), trace_rounds(rounds, step)) if trace else (x, topk))


def stage_verify(stage: Stage, params, cache, lanes: Lanes, pending, drafts, carry, remaining, selection=None, *,
                 kernels: str, copy_pages: int, trace: bool = False):
    """An MTP verify's T = D + 1 rows through this stage's layers. What it commits is decided on the last stage:
    the rounds come back for ``stage_verify_commit`` (with ``trace``: and as a trace records them)."""
    T = drafts.shape[1] + 1
    tokens = jnp.concatenate([pending[:, None], drafts], axis=1)
    _, _, step = verify_context(stage, cache, lanes, remaining, T, selection, kernels=kernels,
                                copy_pages=copy_pages)
    cache = cache.begin_step(step)
    x, topk, cache, rounds = stage.run(params, *stage.input(params, tokens, carry), step, cache)
    return cache, ((x, topk), (rounds, trace_rounds(rounds, step)) if trace else rounds)


def stage_verify_commit(stage: Stage, cache, lanes: Lanes, remaining, rounds, n_emit, *, T: int, kernels: str):
    """Commit what the last stage accepted (``n_emit`` rows a lane), then fill, in the order the whole model's
    verify does (``glm53.steps.verify``: advance, then ``finish_step``)."""
    _, start, step = verify_context(stage, cache, lanes, remaining, T, None, kernels=kernels, copy_pages=0)
    cache = _commit(stage, cache, step, start, n_emit)
    return cache.finish_step(rounds, step), None


EARLY = {"chunk": (stage_chunk, ("kernels", "bulk", "copy_pages")),
         "decode": (stage_decode, ("kernels", "copy_pages", "trace")),
         "verify": (stage_verify, ("kernels", "copy_pages", "trace")),
         "verify_commit": (stage_verify_commit, ("T", "kernels"))}


# ----------------------------------------------------------------------------------------------------------------
# The pipeline
# ----------------------------------------------------------------------------------------------------------------
class Pipeline:
    """The stages of a ``(stage, tp)`` mesh for one model: which layers each holds, its sub-mesh, and the moves of
    arrays between stages and to the host. With several processes (``glm53.distributed``) each stage lies in one
    process; a process runs its stages' programs only, and arrays cross to another process's stage by a collective
    over the two stages' devices (``jax.lax.ppermute``), or reach every process by one over the whole mesh."""

    def __init__(self, cfg: ModelConfig, dtype, mesh: Mesh, params, microbatches: int = 1):
        self.cfg, self.dtype, self.mesh = cfg, dtype, mesh
        self.count = int(mesh.shape["stage"])
        self.tp = int(mesh.shape["tp"])
        self.microbatches = int(microbatches)
        self.layers = stage_layers(cfg, self.count, params)
        self.stage_of_layer = {l: s for s, ls in enumerate(self.layers) for l in ls}
        self.stages = [Stage(cfg, dtype, s, self.count, self.layers[s],
                             Mesh(mesh.devices[s:s + 1], mesh.axis_names)) for s in range(self.count)]
        me = jax.process_index()
        for st in self.stages:
            procs = {d.process_index for d in st.mesh.devices.flat}
            if len(procs) > 1:
                raise ConfigError(f"stage {st.index} spans processes {sorted(procs)}: a stage's tp={self.tp} devices "
                                  "must belong to one process (make tp divide the devices of a process)")
            st.local = procs == {me}
        self.local = [st.local for st in self.stages]
        self.first_local = self.local.index(True)
        self.multiprocess = jax.process_count() > 1
        self.outputs_placement = (NamedSharding(mesh, P()) if self.multiprocess else self.stages[-1].replicated)
        self._split: tuple = (None, None)
        self._embed_copy = None
        self._jits: dict = {}

    @property
    def layer_counts(self) -> tuple[int, ...]:
        """Cache layers of each stage (a host pool page of stage s holds ``copyback_every`` rows of each)."""
        return tuple(len(ls) for ls in self.layers)

    # ---- weights ----
    def leaf_sharding(self, path: tuple[str, ...], shape) -> NamedSharding:
        """Where the parameter at ``path`` (a tuple of keys) of ``shape`` goes: its stage's devices, split over the
        stage's ``tp`` by ``glm53.sharding``'s rules."""
        name = "/".join(path)
        return sharding.leaf_sharding(name, shape, self.stages[owner(name, self.stage_of_layer, self.count)].mesh)

    def place_leaf(self, path: tuple[str, ...], array):
        """One parameter put on its stage's devices as soon as it is drawn or read (``glm53.sharding.Placement``),
        and the embedding also on the last stage where that one reads it. The layers' split is decided from the
        parameters' shapes (``Pipeline`` may be built from ``ShapeDtypeStruct``s), so no device ever holds more
        than its stage's share and the weight being made: a whole GLM-5 (720 GiB in FP8) on one device first, as
        placing a made model needs, fits no GPU. With several processes every process makes every weight and puts
        it on its stage, the other processes' stages included (as ``place`` does)."""
        placed = jax.device_put(array, self.leaf_sharding(path, array.shape))
        if tuple(path) == ("embed_tokens",) and needs_embed_copy(self.cfg, self.count):
            self._embed_copy = jax.device_put(array, self._last_embedding_sharding(array.shape))
        return placed

    def _last_embedding_sharding(self, shape) -> NamedSharding:
        return sharding.leaf_sharding("embed_tokens", shape, self.stages[-1].mesh)

    def place(self, params):
        """``params`` (made on one device) with every parameter on its stage's devices (``place_leaf``). With
        several processes each process places what its stages hold (the others' are global arrays it holds no part
        of): every process starts from the same full parameters."""
        flat = jax.tree_util.tree_map_with_path(
            lambda keys, x: self.place_leaf(tuple(sharding.key_names(keys)), x), params)
        return self.take(flat)

    def take(self, params):
        """``params`` as the model's, each already on its stage (``place_leaf``, or ``restored``)."""
        if needs_embed_copy(self.cfg, self.count) and self._embed_copy is None:
            raise ValueError("the embedding was never placed: no copy of it on the last stage")
        self._split = (params, None)
        return params

    def restore_sharding(self, path: tuple[str, ...], shape) -> NamedSharding:
        """Where orbax restores the parameter at ``path`` (``glm53.checkpoint.read_native``): its stage's devices,
        and for an embedding the last stage reads too, the first and the last stage's devices at once (split in
        two by ``restored``), so it is read once."""
        if tuple(path) == ("embed_tokens",) and needs_embed_copy(self.cfg, self.count):
            pair = Mesh(self.mesh.devices[[0, self.count - 1]], self.mesh.axis_names)
            return sharding.leaf_sharding("embed_tokens", shape, pair)
        return self.leaf_sharding(path, shape)

    def restored(self, params):
        """``params`` as orbax restored them onto ``restore_sharding``: the embedding's two copies taken apart
        (each stage's devices keep theirs; a process holds the copies of its own stages only)."""
        if not needs_embed_copy(self.cfg, self.count):
            return params
        both = params["embed_tokens"]
        data = {shard.device: shard.data for shard in both.addressable_shards}

        def part(sh: NamedSharding):
            mine = [data[d] for d in sh.mesh.devices.flat if d in data]
            return jax.make_array_from_single_device_arrays(both.shape, sh, mine, dtype=both.dtype)

        self._embed_copy = part(self._last_embedding_sharding(both.shape))
        return {**params, "embed_tokens": part(self.leaf_sharding(("embed_tokens",), both.shape))}

    def cast(self, params, shapes):
        """``params`` in the dtypes of ``shapes`` (``glm53.load(dtype=...)``), each cast on its stage's devices.
        With several processes a process casts its stages' parameters only: the others' are global arrays of the
        new dtype it holds no part of (a program on devices all of another process is not this process's to run)."""
        def one(x, s):
            if x.dtype == s.dtype:
                return x
            if x.addressable_shards:
                return x.astype(s.dtype)
            return jax.make_array_from_single_device_arrays(x.shape, x.sharding, [], dtype=s.dtype)

        params = jax.tree_util.tree_map(one, params, shapes)
        if self._embed_copy is not None:
            self._embed_copy = one(self._embed_copy, shapes["embed_tokens"])
        return params

    def params_digest(self, params) -> str:
        """``glm53.checkpoint.params_digest`` of ``params``, the same in every process. With several processes a
        process holds only its stages' parameters, so each leaf's first values are sent from its stage to every
        process. Each process first takes the heads of its own stages (one program a stage), then one collective
        program sends them all: a process waiting in a collective while the other still compiles its part gives
        up after 30 s (gloo's context set-up), which per-stage collectives after uneven work had reached."""
        from glm53 import checkpoint  # checkpoint reads configs and weights; it needs nothing of the pipeline

        if not self.multiprocess:
            return checkpoint.params_digest(params)
        leaves = [(jax.tree_util.keystr(k), x, owner("/".join(sharding.key_names(k)), self.stage_of_layer, self.count))
                  for k, x in jax.tree_util.tree_leaves_with_path(params)]
        n = checkpoint.DIGEST_VALUES
        shapes = [jax.ShapeDtypeStruct((min(n, x.size),), x.dtype) for _, x, _ in leaves]
        heads: list = [None] * len(leaves)
        for st in self.stages:
            if st.local:
                mine = [i for i, (_, _, s) in enumerate(leaves) if s == st.index]
                take = jax.jit(lambda *xs: tuple(x.reshape(-1)[:n] for x in xs), out_shardings=st.replicated)
                for i, h in zip(mine, take(*(leaves[i][1] for i in mine))):
                    heads[i] = h
        glob = [jax.make_array_from_single_device_arrays((self.count, *sds.shape),
                                                         NamedSharding(self.mesh, P("stage")),
                                                         self._blocks(self.mesh, {s}, h, sds))
                for (_, _, s), h, sds in zip(leaves, heads, shapes)]
        owners = [s for _, _, s in leaves]
        publish = jax.jit(lambda *a: tuple(v[s] for v, s in zip(a, owners)),
                          out_shardings=NamedSharding(self.mesh, P()))
        return checkpoint.params_digest(params, heads={name: np.asarray(h.addressable_data(0))
                                                       for (name, _, _), h in zip(leaves, publish(*glob))})

    def stage_params(self, params) -> list[dict]:
        """Each stage's parameters (the last's with its copy of the embedding), for the parameters given (kept
        while they stay the same object: ``Model.params``)."""
        if self._split[0] is not params or self._split[1] is None:
            parts = stage_param_trees(self.cfg, self.layers, params)
            if needs_embed_copy(self.cfg, self.count):
                if self._split[0] is params and self._embed_copy is not None:
                    parts[-1]["embed_tokens"] = self._embed_copy
                else:  # parameters replaced after placement (one process: a plain copy between devices)
                    last = self.stages[-1].mesh
                    spec = params["embed_tokens"].sharding.spec
                    parts[-1]["embed_tokens"] = jax.device_put(params["embed_tokens"], NamedSharding(last, spec))
            self._split = (params, parts)
        return self._split[1]

    # ---- caches ----
    def init_cache(self, offload_mode: bool, cc: CacheConfig, slots: int, capacity: int, pool_pages: int):
        from glm53 import offload
        parts = []
        for st in self.stages:
            if offload_mode:
                parts.append(offload.init_offload(st.config, cc, slots, capacity, pool_pages, self.dtype,
                                                  mesh=st.mesh))
            else:
                parts.append(init_resident(st.config, cc, slots, capacity, self.dtype, mesh=st.mesh))
        return StagedCache(tuple(parts), pipeline=self)

    def cache_bytes(self, cc: CacheConfig, slots: int, capacity: int, pool_pages: int) -> dict:
        """``glm53.memory.cache_bytes`` of the stage whose cache is largest (what one of its devices holds)."""
        per = [memory.cache_bytes(st.config, cc, slots, capacity, pool_pages, self.dtype) for st in self.stages]
        return max(per, key=lambda p: sum(p["device"].values()))

    # ---- moving arrays ----
    def to_stage(self, tree, s: int):
        """Arrays of ``tree`` on stage ``s``'s devices, replicated over them: host data, another stage's outputs
        of this process, or arrays replicated over the whole mesh (several processes: taken from this process's
        copies on those devices)."""
        sh = self.stages[s].replicated

        def put(x):
            if isinstance(x, jax.Array):
                if x.sharding == sh:
                    return x
                if not x.is_fully_addressable:
                    mine = {d.device: d.data for d in x.addressable_shards}
                    return jax.make_array_from_single_device_arrays(
                        x.shape, sh, [mine[d] for d in sh.mesh.devices.flat])
                return jax.device_put(x, sh)
            if isinstance(x, np.ndarray):
                return jax.device_put(x, sh)
            return x

        return jax.tree_util.tree_map(put, tree)

    def _blocks(self, mesh: Mesh, rows: set, x, sds):
        """This process's blocks ``[1, *shape]`` of a global array ``[mesh rows, *shape]`` split over ``mesh``'s first
        axis: ``x``'s data on the devices of the mesh rows in ``rows`` (those of the stage holding x), zeros on the
        others (where the collective writes)."""
        mine = {} if x is None else {d.device: d.data for d in x.addressable_shards}
        out = []
        for i, row in enumerate(mesh.devices):
            for d in row:
                if d.process_index != jax.process_index():
                    continue
                if i in rows and d in mine:
                    out.append(mine[d][None])
                else:
                    out.append(jax.device_put(np.zeros((1, *sds.shape), sds.dtype), d))
        return out

    def send(self, tree, shapes, src: int, dst: int):
        """``tree`` (stage ``src``'s, or None in a process without it) on stage ``dst``'s devices (None in a process
        without them). Within a process: a copy between devices; across processes: a collective over the two
        stages' devices (XLA's collective-permute: the bytes unchanged)."""
        if self.local[src] and self.local[dst]:
            return self.to_stage(tree, dst)
        if not (self.local[src] or self.local[dst]):
            return None
        mesh = Mesh(self.mesh.devices[[src, dst]], ("hop", "tp"))
        leaves, treedef = jax.tree_util.tree_flatten(shapes)
        xs = treedef.flatten_up_to(tree) if tree is not None else [None] * len(leaves)
        glob = [jax.make_array_from_single_device_arrays((2, *sds.shape), NamedSharding(mesh, P("hop")),
                                                         self._blocks(mesh, {0}, x, sds))
                for x, sds in zip(xs, leaves)]
        key = ("send", src, dst)
        fn = self._jits.get(key)
        if fn is None:
            move = jax.shard_map(lambda *a: tuple(jax.lax.ppermute(v, "hop", [(0, 1)]) for v in a), mesh=mesh,
                                 in_specs=P("hop"), out_specs=P("hop"))
            fn = self._jits[key] = jax.jit(move)
        moved = fn(*glob)
        if not self.local[dst]:
            return None
        sh = self.stages[dst].replicated
        dst_devices = set(sh.mesh.devices.flat)
        out = []
        for g, sds in zip(moved, leaves):
            data = {d.device: d.data for d in g.addressable_shards if d.device in dst_devices}
            out.append(jax.make_array_from_single_device_arrays(sds.shape, sh,
                                                                [data[d][0] for d in sh.mesh.devices.flat]))
        return jax.tree_util.tree_unflatten(treedef, out)

    def publish(self, tree, shapes, s: int):
        """Stage ``s``'s outputs for the host: as they are with one process; with several, sent to every device of
        the mesh (a collective over it), so every process reads the same values."""
        if not self.multiprocess:
            return tree
        leaves, treedef = jax.tree_util.tree_flatten(shapes)
        if not leaves:
            return tree
        xs = treedef.flatten_up_to(tree) if self.local[s] else [None] * len(leaves)
        glob = [jax.make_array_from_single_device_arrays((self.count, *sds.shape),
                                                         NamedSharding(self.mesh, P("stage")),
                                                         self._blocks(self.mesh, {s}, x, sds))
                for x, sds in zip(xs, leaves)]
        key = ("publish", s)
        fn = self._jits.get(key)
        if fn is None:
            fn = self._jits[key] = jax.jit(lambda *a: tuple(v[s] for v in a),
                                           out_shardings=NamedSharding(self.mesh, P()))
        return jax.tree_util.tree_unflatten(treedef, list(fn(*glob)))

    def to_host(self, x, s: int) -> np.ndarray:
        """Stage ``s``'s array ``x`` as host data, in every process."""
        if not self.multiprocess:
            return np.asarray(x)
        shapes = jax.ShapeDtypeStruct(x.shape, x.dtype)
        out = self.publish(x if self.local[s] else None, shapes, s)
        return np.asarray(out.addressable_data(0))


def _signature(tree) -> tuple:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return (treedef, tuple((tuple(x.shape), str(x.dtype)) if hasattr(x, "shape") else x for x in leaves))


def _abstract(tree):
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, "shape") else x,
                                  tree)


class PipelineSteps:
    """The engine's steps (``glm53.steps.Steps``' names and signatures) run stage by stage. Model steps pass the
    activation (and the last own-indexer layer's selection, which a shared-indexer layer at the start of the next
    stage reuses) from stage to stage; lifecycle steps run on every stage with the same arguments. A process runs
    only its own stages' programs; what another process needs of them (an activation, the step's outputs, the
    tokens an MTP verify accepted) is sent, its shape known from the program's abstract evaluation."""

    def __init__(self, pipeline: Pipeline, module):
        self.pipeline = pipeline
        self.module = module
        self.last = Steps(module, net=LastStage(pipeline.stages[-1]))  # the last stage's, and every lifecycle step
        self._jits: dict = {}
        self._shapes: dict = {}

    @property
    def stages(self):
        return self.pipeline.stages

    def _to(self, tree, s: int):
        return self.pipeline.to_stage(tree, s)

    def _early(self, name: str, s: int, cache):
        key = (name, s, jax.tree_util.tree_structure(cache))
        fn = self._jits.get(key)
        if fn is None:
            f, static = EARLY[name]
            shardings = jax.tree_util.tree_map(lambda x: x.sharding, cache)
            with_params = name != "verify_commit"
            fn = jax.jit(functools.partial(f, self.stages[s]), static_argnames=static,
                         donate_argnums=(1,) if with_params else (0,),
                         out_shardings=(shardings, self.stages[s].replicated))
            self._jits[key] = fn
        return fn

    def _out_shapes(self, key, evaluate):
        """The abstract outputs of a program (memoised by ``key``): what a process that does not run it needs to
        receive them."""
        got = self._shapes.get(key)
        if got is None:
            got = self._shapes[key] = evaluate()
        return got

    def _run_early(self, name: str, s: int, params, part, args: tuple, kw: dict):
        """Stage ``s``'s program ``name``: (part, outputs, their shapes), outputs None where this process does
        not hold the stage."""
        f, _ = EARLY[name]
        key = ("early", name, s, _signature(args), tuple(sorted(kw.items())))
        shapes = (None if not self.pipeline.multiprocess else self._out_shapes(key, lambda: jax.eval_shape(
            lambda p, c, *a: f(self.stages[s], p, c, *a, **kw)[1] if name != "verify_commit"
            else None, _abstract(params), _abstract(part), *_abstract(args))))
        if not self.stages[s].local:
            return part, None, shapes
        if name == "verify_commit":
            part, out = self._early(name, s, part)(part, *self._to(args, s), **kw)
        else:
            part, out = self._early(name, s, part)(params, part, *self._to(args, s), **kw)
        return part, out, shapes

    def _run_last(self, name: str, params, part, args: tuple, kw: dict):
        """The last stage's step ``name`` (``glm53.steps``' own, through ``LastStage``): (part, outputs for the
        host, published to every process)."""
        s = len(self.stages) - 1
        with_model = name in ("chunk", "decode", "verify", "draft", "mtp_forward")
        shapes = None
        if self.pipeline.multiprocess:
            from glm53.steps import STEPS
            f = STEPS[name][0]
            key = ("last", name, _signature(args), tuple(sorted(kw.items())),
                   None if params is None else _signature(params.get("carry")))

            def evaluate():
                if with_model:
                    return jax.eval_shape(lambda p, c, *a: f(self.last.net, p, c, *a, **kw)[1],
                                          _abstract(params), _abstract(part), *_abstract(args))
                return jax.eval_shape(lambda c, *a: f(c, *a, **kw)[1], _abstract(part), *_abstract(args))

            shapes = self._out_shapes(key, evaluate)
        out = None
        if self.stages[s].local:
            if with_model:
                part, out = self.last(name, params, part, *self._to(args, s), **kw)
            else:
                part, out = self.last(name, part, *self._to(args, s), **kw)
        return part, (self.pipeline.publish(out, shapes, s) if shapes is not None else out)

    def for_cache(self, name: str, cache, compiler_options: tuple = ()):
        if compiler_options:  # Engine refuses them on pipeline stages before it gets here
            raise ConfigError("compiler_options are not applied to pipeline stages' programs")
        return functools.partial(self.__call__, name)

    def __call__(self, name: str, *args, **kw):
        if name in ("chunk", "decode", "verify"):
            return getattr(self, "_" + name)(*args, **kw)
        if name in ("draft", "mtp_forward"):  # the MTP layer's: the last stage alone
            params, cache, *rest = args
            part, out = self._run_last(name, self._last_params(params), cache.parts[-1], tuple(rest), kw)
            if kw.get("trace"):
                out = out[:-1] + (self._merge_traces([{}] * (len(self.stages) - 1) + [out[-1]]),)
            return cache.replace(parts=cache.parts[:-1] + (part,)), out
        cache, *rest = args
        parts = []
        for s, part in enumerate(cache.parts):
            mine = rest
            if name == "write_slot":
                mine = self._slot_data(rest, s)
            elif name == "write_pages":
                mine = (rest[0][s], *rest[1:])
            if self.stages[s].local:
                part, _ = self.last(name, part, *self._to(mine, s), **kw)
            parts.append(part)
        return cache.replace(parts=tuple(parts)), None

    def _last_params(self, params, carry=None):
        p = dict(self.pipeline.stage_params(params)[-1])
        if carry is not None:
            p["carry"] = carry
        return p

    def _forward(self, name: str, params, parts: list, args_of, kw: dict):
        """Every stage but the last runs ``name`` on what the stage before sent; returns (the carry on the last
        stage, each stage's second output, the trace each recorded where ``kw`` asks for traces: sent to every
        process). A process that holds neither end of a hop carries the activation's abstract shape instead, for
        the next stage's abstract evaluation."""
        sp = self.pipeline.stage_params(params)
        carry, extras, traces = None, [], []
        for s in range(len(parts) - 1):
            parts[s], out, shapes = self._run_early(name, s, sp[s], parts[s], args_of(s, carry), kw)
            if name == "verify" or kw.get("trace"):
                (carry, extra) = out if out is not None else (None, None)
                carry_shapes, extra_shapes = shapes if shapes is not None else (None, None)
            else:
                carry, extra, carry_shapes, extra_shapes = out, None, shapes, None
            if kw.get("trace"):  # decode: the extra output is the trace; verify: (rounds, trace)
                second = (lambda x: x) if name == "decode" else (lambda x: None if x is None else x[1])
                tr, tr_shapes = second(extra), second(extra_shapes)
                traces.append(self.pipeline.publish(tr, tr_shapes, s) if tr_shapes is not None else tr)
                if name == "verify":
                    extra = None if extra is None else extra[0]
            extras.append(extra)
            carry = self.pipeline.send(carry, carry_shapes, s, s + 1)
            if carry is None:
                carry = carry_shapes
        return carry, extras, traces

    def _merge_traces(self, traces: list) -> dict:
        """One step's trace for the whole model from each stage's (``glm53.offload.trace_rounds``, layers numbered
        in that stage's cache): layers renumbered in the model's order, every round padded to the step's widest
        as the whole model's fill pads them (``offload.merge_rounds``: entries at position 0, not valid, served by
        the ring), so the trace is the one a single device records."""
        got = [(s, t) for s, t in enumerate(traces) if t]
        if not got:
            return {}
        first = np.cumsum([0] + [st.config.num_cache_layers for st in self.stages])
        M = max(int(t["pos"].shape[2]) for _, t in got)
        last = got[-1][1]
        # With several processes every piece is replicated over the whole mesh (published): merged on the host.
        xp = np if self.pipeline.multiprocess else jnp

        def put(x, k):
            return np.asarray(x) if xp is np else jax.device_put(x, last[k].sharding)

        def pad(a, value):
            return xp.pad(a, ((0, 0), (0, 0), (0, M - a.shape[2])), constant_values=value)

        return {"layers": xp.concatenate([put(t["layers"], "layers") + int(first[s]) for s, t in got]),
                **{k: xp.concatenate([pad(put(t[k], k), v) for _, t in got])
                   for k, v in (("pos", 0), ("valid", False), ("in_ring", True))},
                "active": put(last["active"], "active"), "start": put(last["start"], "start")}

    # ---- model steps ----
    def _chunk(self, params, cache, lanes, tokens, n_valid, *, outputs, kernels, bulk, copy_pages):
        parts = list(cache.parts)
        carry, _, _ = self._forward("chunk", params, parts, lambda s, c: (lanes, tokens, c, n_valid),
                                    dict(kernels=kernels, bulk=bulk, copy_pages=copy_pages))
        parts[-1], out = self._run_last("chunk", self._last_params(params, carry), parts[-1],
                                        (lanes, tokens, n_valid),
                                        dict(outputs=outputs, kernels=kernels, bulk=bulk, copy_pages=copy_pages))
        return cache.replace(parts=tuple(parts)), out

    def _decode(self, params, cache, lanes, tokens, remaining, seed, temperature, top_p, stop_ids, selection=None,
                *, greedy, kernels, copy_pages, trace=False):
        B = int(lanes.slot.shape[0])
        # Traced steps run whole (a trace's rows are every lane of one step). A bucket of fewer lanes than the
        # engine's largest (which micro-batches divide: Engine checks) splits into as many equal groups as it can.
        M = 1 if trace else math.gcd(self.pipeline.microbatches, B)
        parts, outs = list(cache.parts), []
        # Micro-batches over the lanes, issued in order: JAX dispatches asynchronously, so stage s runs micro-batch
        # m + 1 while stage s + 1 runs m. Lanes are independent sessions (every cache update is per slot), but a
        # program of B / M lanes is another shape: XLA may pick other matmul code for it and round differently in
        # the last bit (so micro-batches are 1 unless asked for: bit-identical to one device).
        for m in range(M):
            cut = slice(m * B // M, (m + 1) * B // M)
            mb_lanes, mb_tokens, mb_remaining, mb_sel = (
                (lanes, tokens, remaining, selection) if M == 1 else
                jax.tree_util.tree_map(lambda x: x[cut], (lanes, tokens, remaining, selection)))
            traced = dict(trace=True) if trace else {}
            carry, _, early = self._forward("decode", params, parts,
                                            lambda s, c: (mb_lanes, mb_tokens, c, mb_remaining, mb_sel),
                                            dict(kernels=kernels, copy_pages=copy_pages, **traced))
            parts[-1], out = self._run_last("decode", self._last_params(params, carry), parts[-1],
                                            (mb_lanes, mb_tokens, mb_remaining, seed, temperature, top_p, stop_ids,
                                             mb_sel), dict(greedy=greedy, kernels=kernels, copy_pages=copy_pages,
                                                           **traced))
            if trace:
                out = out[:-1] + (self._merge_traces(early + [out[-1]]),)
            outs.append(out)
        out = outs[0] if M == 1 else tuple(jnp.concatenate(xs) for xs in zip(*outs))
        return cache.replace(parts=tuple(parts)), out

    def _verify(self, params, cache, lanes, pending, drafts, draft_p, remaining, seed, temperature, top_p, stop_ids,
                selection=None, *, greedy, accept_override, kernels, copy_pages, trace=False):
        traced = dict(trace=True) if trace else {}
        parts = list(cache.parts)
        carry, rounds, early = self._forward("verify", params, parts,
                                             lambda s, c: (lanes, pending, drafts, c, remaining, selection),
                                             dict(kernels=kernels, copy_pages=copy_pages, **traced))
        parts[-1], out = self._run_last("verify", self._last_params(params, carry), parts[-1],
                                        (lanes, pending, drafts, draft_p, remaining, seed, temperature, top_p,
                                         stop_ids, selection),
                                        dict(greedy=greedy, accept_override=accept_override, kernels=kernels,
                                             copy_pages=copy_pages, **traced))
        if trace:
            out = out[:-1] + (self._merge_traces(early + [out[-1]]),)
        n_emit = out[1]  # what the last stage committed: every stage commits the same rows
        for s in range(len(parts) - 1):
            parts[s], _, _ = self._run_early("verify_commit", s, None, parts[s],
                                             (lanes, remaining, rounds[s], n_emit),
                                             dict(T=drafts.shape[1] + 1, kernels=kernels))
        return cache.replace(parts=tuple(parts)), out

    # ---- reads the host makes ----
    def sample_first(self, params, cache, lanes, seed, temperature, top_p, *, greedy: bool):
        s = len(self.stages) - 1
        args = (lanes, seed, temperature, top_p)
        out = None
        if self.stages[s].local:
            out = self.last.sample_first(self._last_params(params), cache.parts[-1], *self._to(args, s),
                                         greedy=greedy)
        if not self.pipeline.multiprocess:
            return out
        from glm53.steps import sample_first
        shapes = self._out_shapes(("sample_first", _signature(args), greedy), lambda: jax.eval_shape(
            lambda p, c, *a: sample_first(self.last.net, p, c, *a, greedy=greedy),
            _abstract(self._last_params(params)), _abstract(cache.parts[-1]), *_abstract(args)))
        return self.pipeline.publish(out, shapes, s)

    def read_slot(self, cache, slot, *, kernels: str):
        """One slot's save data for the whole model, in layer order (host arrays, in every process)."""
        from glm53.steps import read_slot
        got = []
        for s, p in enumerate(cache.parts):
            data = self.last.read_slot(p, self._to(slot, s), kernels=kernels) if self.stages[s].local else None
            if self.pipeline.multiprocess:
                shapes = self._out_shapes(("read_slot", s), lambda: jax.eval_shape(
                    lambda c, i: read_slot(c, i, kernels=kernels), _abstract(p), _abstract(slot)))
                data = self.pipeline.publish(data, shapes, s)
                data = jax.tree_util.tree_map(lambda x: np.asarray(x.addressable_data(0)), data)
            got.append(jax.device_get(data))
        lengths = {(int(g["length"]), int(g["mtp_length"])) for g in got}
        if len(lengths) != 1:
            raise RuntimeError(f"the stages hold different lengths for slot {int(slot)}: {sorted(lengths)} (an "
                               "engine bug): refusing to read an inconsistent session")
        out = dict(got[-1])
        out["rows"] = {n: np.concatenate([g["rows"][n] for g in got]) for n in got[-1]["rows"]}
        out["index_keys"] = np.concatenate([g["index_keys"] for g in got])
        if got[-1]["index_key_scale"] is not None:
            out["index_key_scale"] = np.concatenate([g["index_key_scale"] for g in got])
        return out

    def _slot_data(self, rest, s: int):
        """``write_slot``'s arguments for stage ``s``: its layers' rows and its own-indexer layers' keys."""
        slot, rows, keys, scale, hidden, length, mtp_length = rest
        lo = sum(st.config.num_cache_layers for st in self.stages[:s])
        hi = lo + self.stages[s].config.num_cache_layers
        klo = sum(len(st.config.full_indexer_layers) for st in self.stages[:s])
        khi = klo + len(self.stages[s].config.full_indexer_layers)
        return (slot, {n: r[lo:hi] for n, r in rows.items()}, keys[klo:khi],
                None if scale is None else scale[klo:khi], hidden, length, mtp_length)

    def read_pages(self, cache, pages, *, kernels: str):
        """Each stage's rows of ``pages`` (a tuple, one entry per stage, None for stages of another process:
        ``write_pages`` takes it back on the same stages)."""
        return tuple(self.last.read_pages(p, self._to(pages, s), kernels=kernels) if self.stages[s].local else None
                     for s, p in enumerate(cache.parts))

    def lower(self, name: str, *args, **kw):
        raise ConfigError("lowering a step for profiling or memory analysis is not built for pipeline stages "
                          "(each stage runs its own programs)")
