"""GLM-5 (transformers ``glm_moe_dsa``) in Flax Linen, with the KV cache passed in and out as data.

Semantics follow transformers' ``modeling_glm_moe_dsa.py``; where glm53 computes the same function differently, the
comment says so:
- Attention is *absorbed* MLA: ``kv_b_proj`` is folded into the query and the output, so attention runs in the
  512-d latent space over exactly the rows the KV cache stores (the reference expands K/V per head instead).
- DSA selection gathers the top-k rows and attends over them (the reference masks a dense score matrix); the set
  of attended positions is the same.
- Top-k ties are broken by one fixed rule everywhere: the earlier position wins (``kernels_pallas.indexer_topk``).
- MoE experts run as sorted grouped matmuls (``kernels_pallas.grouped_matmul``; ``jax.lax.ragged_dot`` as its
  reference) instead of a loop over experts.

Every layer call takes a ``Step`` (positions of the tokens being processed, the session slot of each lane) and the
cache pytree and returns the new cache plus what the layer read (a ``Round``, for the offload fill at the end of the
step); the cache type decides where rows live (``glm53.cache`` / ``glm53.offload``), so this file is the same for
both.
"""

from __future__ import annotations

from typing import Any

import flax.errors
import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from glm53.cache import Lanes
from glm53.config import ModelConfig
from kernels_pallas import ops
from kernels_pallas.grouped_matmul import SCALE_BLOCK

Array = jax.Array
F32 = jnp.float32


# ----------------------------------------------------------------------------------------------------------------
# Step context: where the tokens of this call sit in each session's history.
# ----------------------------------------------------------------------------------------------------------------
@flax.struct.dataclass
class Step:
    positions: Array  # int32[B, T] absolute position of each token
    write_positions: Array  # int32[B, T] = positions for rows the step writes, capacity (dropped) otherwise
    cos: Array  # [B, T, rope/2] in the compute dtype
    sin: Array
    lanes: Lanes  # the session slot of each lane; inactive lanes are padding
    # Benchmarks may dictate the DSA selection (int32[B, T, K]) to control locality. The indexer still runs and its
    # result is merged with a traced select, so XLA cannot drop it: the cost of a step is unchanged.
    selection: Array | None = None
    # What the step is compiled for (static): the kernel implementation ("auto" | "pallas" | "reference", see
    # kernels_pallas.ops), whether its rounds fill the offload hot cache (decode, verify), whether they read the
    # history in bulk (prefill / large append chunks), how often one position can repeat in a layer's round (verify
    # rows, MTP drafts), and how many pages per lane its offload copyback may write first.
    kernels: str = flax.struct.field(pytree_node=False, default="auto")
    fill: bool = flax.struct.field(pytree_node=False, default=False)
    bulk: bool = flax.struct.field(pytree_node=False, default=False)
    repeats: int = flax.struct.field(pytree_node=False, default=1)
    copy_pages: int = flax.struct.field(pytree_node=False, default=0)


def make_step(start: Array, n_valid: Array, T: int, capacity: int, cfg: ModelConfig, dtype, lanes: Lanes, *,
              write_mask: Array | None = None, selection: Array | None = None, **static) -> Step:
    """Positions ``start[b] + t`` for ``t < T``. Tokens ``t >= n_valid[b]``, tokens of inactive lanes and tokens where
    ``write_mask`` is False write nothing."""
    t = jnp.arange(T, dtype=jnp.int32)[None, :]
    positions = start[:, None].astype(jnp.int32) + t
    writes = (t < n_valid[:, None]) & lanes.active[:, None] & (positions >= 0)
    if write_mask is not None:
        writes = writes & write_mask
    write_positions = jnp.where(writes, positions, capacity)
    cos, sin = rope_cos_sin(positions, cfg.qk_rope_head_dim, cfg.rope_theta, dtype)
    return Step(positions=positions, write_positions=write_positions, cos=cos, sin=sin, lanes=lanes,
                selection=selection, **static)


def rope_cos_sin(positions: Array, dim: int, theta: float, dtype) -> tuple[Array, Array]:
    # Same float32 arithmetic as the reference's default RoPE (inv_freq in f32, angles in f32, then cast).
    inv_freq = (1.0 / (np.float32(theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))))
    freqs = positions.astype(F32)[..., None] * jnp.asarray(inv_freq, F32)
    return jnp.cos(freqs).astype(dtype), jnp.sin(freqs).astype(dtype)


def apply_rope_interleaved(x: Array, cos: Array, sin: Array) -> Array:
    """Rotate interleaved pairs (x0,x1),(x2,x3)...; output de-interleaved [evens', odds'] like the reference.

    ``cos``/``sin`` broadcast against ``x[..., ::2]``. The output layout differs from the input's, but queries and
    keys get the same permutation, so their dot products are unchanged.
    """
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def rms_norm(x: Array, weight: Array, eps: float) -> Array:
    # Reference: normalise in f32, cast back to the input dtype, then scale by the weight.
    xf = x.astype(F32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def layer_norm(x: Array, weight: Array, bias: Array, eps: float) -> Array:
    xf = x.astype(F32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + eps)
    return (y * weight.astype(F32) + bias.astype(F32)).astype(x.dtype)


# ----------------------------------------------------------------------------------------------------------------
# Modules. Parameter names follow the HF checkpoint (minus ".weight"); matrices are stored [in, out].
# ----------------------------------------------------------------------------------------------------------------
def _normal(cfg: ModelConfig):
    return nn.initializers.normal(stddev=cfg.initializer_range)


def _weight(module: nn.Module, name: str, init_fn, shape: tuple, dtype) -> jax.Array:
    """``module.param(name, init_fn, shape, dtype)``, but a stored weight's shape is checked against ``shape``
    directly. Flax checks it by tracing ``init_fn`` (``jax.eval_shape``) at every apply: ~0.7-1 ms per weight each
    time a step is traced. GLM-5's decode step (1,730 weights) traced in 2.5-3.1 s instead of 3.7-4.6 s on a CPU
    (``experiments/results/probes/trace_glm5_step.py``), and every other step likewise. The weights themselves are
    drawn by ``glm53.params.init_params``; ``init_fn`` gives only the shapes and dtypes (``param_shapes``) and
    whatever a direct ``GLM5.init`` draws. The error for a weight of another shape is Flax's own."""
    if not module.has_variable("params", name):
        return module.param(name, init_fn, shape, dtype)
    value = module.get_variable("params", name)
    if value.shape != tuple(shape):
        raise flax.errors.ScopeParamShapeError(name, module.scope.path_text, value.shape, tuple(shape))
    return value


class RMSNorm(nn.Module):
    features: int
    eps: float
    dtype: Any

    @nn.compact
    def __call__(self, x):
        w = _weight(self, "weight", nn.initializers.ones, (self.features,), self.dtype)
        return rms_norm(x, w, self.eps)


# XLA's GPU simplifier rewrites a dot with a one-row side, when the operands hold fewer than 10M elements together
# (``IsMatrixMultiplicationTooSmallForRewriting``), into a multiply and a reduce instead of a GEMM, and no compile
# option turns that off in jaxlib 0.11. At batch 1 that took the indexer's wq_b ([2048] x [2048, 4096]): a multiply
# writing the whole product and a reduce reading it back, ~21 us a layer where its weight reads in ~4
# (experiments/results/probes/profile_decode_8k_model_d2060e0.json). Two rows are no vector, so XLA keeps a GEMM
# that reads the weight once: padded with a zero row, wq_b took ~7.7 us a layer with its pad kernel
# (profile_decode_8k_model_d9ae3a9.json). Narrow outputs lose by it: the router ([6144] x [6144, 16], f32) became a
# 4.8 us cuBLAS GEMM plus a pad where its reduce took ~1.5, and kv_a_proj_with_mqa (576 wide) about broke even; the
# absorbed per-head einsums (w_uk, w_uv) gained less than their pad and slice kernels cost (26d9ee4). So only dots
# at least ``_TWO_ROW_MIN_WIDTH`` wide are padded. Outputs equal the one-row dot up to summation order; resident and
# offloaded caches run the same program, so they stay bit-identical to each other.
_XLA_DOT_TO_REDUCE_MAX_ELEMENTS = 10_000_000
_TWO_ROW_MIN_WIDTH = 1024


def pads_to_two_rows(x: Array, w: Array) -> bool:
    """Whether ``matmul`` pads ``x @ w``: one token, a wide ``w``, and operands XLA would strength-reduce."""
    return (int(np.prod(x.shape[:-1])) == 1 and w.shape[-1] >= _TWO_ROW_MIN_WIDTH
            and x.size + w.size < _XLA_DOT_TO_REDUCE_MAX_ELEMENTS)


def matmul(x: Array, w: Array) -> Array:
    """``x @ w`` over ``x``'s last axis, kept a GEMM when ``x`` holds one token and ``w`` is wide (see above)."""
    if not pads_to_two_rows(x, w):
        return jnp.dot(x, w)
    row = x.reshape(1, x.shape[-1])
    y = jnp.dot(jnp.concatenate([row, jnp.zeros_like(row)], axis=0), w)
    return y[:1].reshape(*x.shape[:-1], w.shape[-1])


class Linear(nn.Module):
    features_in: int
    features_out: int
    cfg: ModelConfig
    dtype: Any

    @nn.compact
    def __call__(self, x):
        w = _weight(self, "kernel", _normal(self.cfg), (self.features_in, self.features_out), self.dtype)
        return matmul(x, w.astype(x.dtype) if x.dtype != w.dtype else w)


class Indexer(nn.Module):
    """DSA lightning indexer: scores every cached key for each query and selects the top-k positions."""

    cfg: ModelConfig
    layer: int
    dtype: Any
    cache_layer: int | None = None  # this layer's index in its cache (None: ``layer``; see DecoderLayer)

    def setup(self):
        c = self.cfg
        self.wq_b = Linear(c.q_lora_rank, c.index_n_heads * c.index_head_dim, c, self.dtype)
        self.wk = Linear(c.hidden_size, c.index_head_dim, c, self.dtype)
        self.k_norm_weight = _weight(self, "k_norm_weight", nn.initializers.ones, (c.index_head_dim,), self.dtype)
        self.k_norm_bias = _weight(self, "k_norm_bias", nn.initializers.zeros, (c.index_head_dim,), self.dtype)
        # The reference keeps weights_proj in float32 (_keep_in_fp32_modules) and feeds it float32 activations.
        self.weights_proj = _weight(self, "weights_proj", _normal(c), (c.hidden_size, c.index_n_heads), F32)

    def keys(self, x: Array, step: Step) -> Array:
        """The indexer keys ``[B, T, index_head_dim]`` of the tokens ``x`` (what the cache stores)."""
        r = self.cfg.qk_rope_head_dim
        k = layer_norm(self.wk(x), self.k_norm_weight, self.k_norm_bias, 1e-6)
        # The indexer puts its rope dims first (MLA puts them last).
        return jnp.concatenate([apply_rope_interleaved(k[..., :r], step.cos, step.sin), k[..., r:]], axis=-1)

    def __call__(self, x: Array, q_resid: Array, step: Step, cache):
        c = self.cfg
        B, T, _ = x.shape
        r = c.qk_rope_head_dim
        q = self.wq_b(q_resid).reshape(B, T, c.index_n_heads, c.index_head_dim)
        q = jnp.concatenate([apply_rope_interleaved(q[..., :r], step.cos[:, :, None], step.sin[:, :, None]),
                             q[..., r:]], axis=-1)
        at = _cache_index(self)
        cache = cache.write_index_keys(at, self.keys(x, step), step)
        key_planes, key_scales, key_plane = cache.index_keys_for(at, step)
        weights = jnp.dot(x.astype(F32), self.weights_proj) * (c.index_n_heads ** -0.5)
        scores = ops.indexer_scores(q, weights, key_planes, key_plane, step.positions, key_scales,
                                    softmax_scale=c.index_head_dim ** -0.5, precision=cache.indexer_precision,
                                    key_dtype=cache.index_key_dtype, impl=step.kernels)
        k_sel = min(c.index_topk, cache.capacity)
        topk = ops.topk_positions(scores, k_sel, step.positions, impl=step.kernels)
        if step.selection is not None:
            if step.selection.shape != topk.shape:
                raise ValueError(f"selection override has shape {step.selection.shape}, the indexer selects "
                                 f"{topk.shape}")
            topk = jnp.where(step.selection >= 0, step.selection.astype(topk.dtype), topk)
        return topk, cache


class MLAttention(nn.Module):
    cfg: ModelConfig
    layer: int
    dtype: Any
    cache_layer: int | None = None

    def setup(self):
        c = self.cfg
        h = c.num_attention_heads
        self.q_a_proj = Linear(c.hidden_size, c.q_lora_rank, c, self.dtype)
        self.q_a_layernorm = RMSNorm(c.q_lora_rank, 1e-6, self.dtype)  # reference default eps, not rms_norm_eps
        self.q_b_proj = Linear(c.q_lora_rank, h * c.qk_head_dim, c, self.dtype)
        self.kv_a_proj_with_mqa = Linear(c.hidden_size, c.kv_row_dim, c, self.dtype)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, 1e-6, self.dtype)
        # Used only as absorbed weights (never applied as a layer), so it is a bare [kv_lora, heads*(nope+v)] param.
        self.kv_b_proj = _weight(self, "kv_b_proj", _normal(c),
                                 (c.kv_lora_rank, h * (c.qk_nope_head_dim + c.v_head_dim)), self.dtype)
        self.o_proj = Linear(h * c.v_head_dim, c.hidden_size, c, self.dtype)
        self.indexer = (Indexer(c, self.layer, self.dtype, self.cache_layer)
                        if c.layer_indexer_type(self.layer) == "full" else None)

    def _kv(self, x: Array, step: Step) -> tuple[Array, Array]:
        """The row the cache stores for each token: (latent [B, T, kv_lora], rope key [B, T, rope])."""
        c = self.cfg
        ckv = self.kv_a_proj_with_mqa(x)
        latent = self.kv_a_layernorm(ckv[..., :c.kv_lora_rank])
        return latent, apply_rope_interleaved(ckv[..., c.kv_lora_rank:], step.cos, step.sin)

    def write_kv(self, x: Array, step: Step, cache):
        """Only store the tokens' KV rows and indexer keys (no attention): the MTP layer's rows of verified
        positions, whose outputs nobody needs."""
        latent, k_rope = self._kv(x, step)
        cache = cache.write_rows(_cache_index(self), latent, k_rope, step)
        if self.indexer is not None:
            cache = cache.write_index_keys(_cache_index(self), self.indexer.keys(x, step), step)
        return cache

    def __call__(self, x: Array, step: Step, cache, prev_topk: Array | None):
        c = self.cfg
        B, T, _ = x.shape
        h, nope, v = c.num_attention_heads, c.qk_nope_head_dim, c.v_head_dim
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_resid).reshape(B, T, h, c.qk_head_dim)
        q_nope = q[..., :nope]
        q_rope = apply_rope_interleaved(q[..., nope:], step.cos[:, :, None], step.sin[:, :, None])
        latent, k_rope = self._kv(x, step)
        # Write first, then read: the current tokens attend to themselves through the cache, so they see the same
        # (possibly quantised) bytes as every later step will.
        cache = cache.write_rows(_cache_index(self), latent, k_rope, step)

        if self.indexer is not None:
            topk, cache = self.indexer(x, q_resid, step, cache)
        else:
            if prev_topk is None:
                raise ValueError(f"layer {self.layer} has a shared indexer but no earlier full layer")
            topk = prev_topk
        attend = topk <= step.positions[..., None]  # causal; masks the "-inf" picks of rows with < K history
        valid = attend & (step.write_positions < cache.capacity)[..., None]  # ... and rows that write nothing
        lat_sel, rope_sel, cache, round_ = cache.gather_rows(_cache_index(self), topk, valid, step, x.dtype)

        w_kv_b = self.kv_b_proj.reshape(c.kv_lora_rank, h, nope + v)
        w_uk, w_uv = w_kv_b[..., :nope].astype(x.dtype), w_kv_b[..., nope:].astype(x.dtype)
        q_lat = jnp.einsum("bthd,chd->bthc", q_nope, w_uk)
        # XLA's einsums, not kernels_pallas.mla_decode: that fused kernel measured slower at every decode size on the
        # H200 (14.3 against 13.8 us a layer at one row, 36.0 against 29.4 at ten; bench_mla_decode_c53beac.json).
        scores = (jnp.einsum("bthc,btkc->bthk", q_lat, lat_sel, preferred_element_type=F32)
                  + jnp.einsum("bthr,btkr->bthk", q_rope, rope_sel, preferred_element_type=F32))
        scores = scores * c.softmax_scale
        scores = jnp.where(attend[:, :, None, :], scores, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
        o_lat = jnp.einsum("bthk,btkc->bthc", probs, lat_sel)
        o = jnp.einsum("bthc,chv->bthv", o_lat, w_uv).reshape(B, T, h * v)
        return self.o_proj(o), cache, topk, round_


class MLP(nn.Module):
    cfg: ModelConfig
    intermediate: int
    dtype: Any

    @nn.compact
    def __call__(self, x, kernels: str = "auto"):
        del kernels
        c = self.cfg
        g = Linear(c.hidden_size, self.intermediate, c, self.dtype, name="gate_proj")(x)
        u = Linear(c.hidden_size, self.intermediate, c, self.dtype, name="up_proj")(x)
        return Linear(self.intermediate, c.hidden_size, c, self.dtype, name="down_proj")(jax.nn.silu(g) * u)


def route(x: Array, router: Array, bias: Array, cfg: ModelConfig) -> tuple[Array, Array]:
    """Sigmoid router with bias-corrected, group-limited choice; weights from the uncorrected scores."""
    n = x.shape[0]
    scores = jax.nn.sigmoid(jnp.dot(x.astype(F32), router))  # [N, E]
    choice = scores + bias
    if cfg.n_group > 1:
        per = cfg.n_routed_experts // cfg.n_group
        grouped = choice.reshape(n, cfg.n_group, per)
        group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [N, G]
        _, top_groups = jax.lax.top_k(group_scores, cfg.topk_group)
        keep = jnp.zeros((n, cfg.n_group), bool).at[jnp.arange(n)[:, None], top_groups].set(True)
        choice = jnp.where(jnp.repeat(keep, per, axis=1), choice, -jnp.inf)
    _, idx = jax.lax.top_k(choice, cfg.num_experts_per_tok)
    w = jnp.take_along_axis(scores, idx, axis=1)
    if cfg.norm_topk_prob:
        w = w / (w.sum(-1, keepdims=True) + 1e-20)
    return idx, w * cfg.routed_scaling_factor


def _experts(xs, w_gate, w_up, w_down, sizes, scale: dict, kernels: str):
    """The routed experts' SwiGLU over rows ``xs`` sorted by expert (``sizes`` rows each)."""
    # Gate, up and the SwiGLU in one launch (2 fewer a MoE layer): batch-1 decode of h200_bench 3.49 -> 3.39 ms a
    # step on the H200 (experiments/results/generate_8k_swiglu_ab_7156d33.json).
    hidden = ops.grouped_swiglu(xs, w_gate, w_up, sizes, scale["gate"], scale["up"], impl=kernels)
    return ops.grouped_matmul(hidden.astype(xs.dtype), w_down, sizes, scale["down"], impl=kernels)


def _tp_mesh(w):
    """The (abstract) mesh ``w`` is placed on when it has a ``tp`` axis of several devices, else None (one device,
    or outside a mesh)."""
    mesh = getattr(jax.typeof(w).sharding, "mesh", None)
    if mesh is None or "tp" not in getattr(mesh, "axis_names", ()) or mesh.shape["tp"] == 1:
        return None
    return mesh


class MoE(nn.Module):
    cfg: ModelConfig
    dtype: Any

    @nn.compact
    def __call__(self, x, kernels: str = "auto"):
        c = self.cfg
        E, H, I = c.n_routed_experts, c.hidden_size, c.moe_intermediate_size
        router = _weight(self, "gate", nn.initializers.normal(c.initializer_range), (H, E), F32)
        bias = _weight(self, "e_score_correction_bias", nn.initializers.zeros, (E,), F32)
        w_gate = _weight(self, "experts_gate_proj", _normal(c), (E, H, I), self.dtype)
        w_up = _weight(self, "experts_up_proj", _normal(c), (E, H, I), self.dtype)
        w_down = _weight(self, "experts_down_proj", _normal(c), (E, I, H), self.dtype)
        # FP8 experts (glm53.params.quantize_experts): e4m3 weights plus one scale per 128 x 128 block, dequantised
        # inside the grouped matmul; the parameters themselves say which (no flag to keep in sync).
        names = {n: f"experts_{n}_proj_scale" for n in ("gate", "up", "down")}
        scale = {n: self.get_variable("params", v) if self.has_variable("params", v) else None
                 for n, v in names.items()}
        shape = x.shape
        xf = x.reshape(-1, H)
        n, k = xf.shape[0], c.num_experts_per_tok
        idx, w = route(xf, router, bias, c)
        # Sort (token, expert) pairs by expert so each expert's tokens are one contiguous group of a ragged matmul.
        flat = idx.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        xs = xf[order // k]
        sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
        mesh = _tp_mesh(w_gate)
        fp8 = scale["gate"] is not None
        if mesh is not None and ops.resolve(kernels)[0] and (not fp8 or (I // mesh.shape["tp"]) % SCALE_BLOCK == 0):
            # The Pallas kernel has no partitioning rule: left to GSPMD, each device would gather every expert's
            # whole weights before it (a custom call's operands are replicated), every layer and step. Each device
            # multiplies by its own slice of the experts' width instead and the partial outputs are summed, the
            # split the rules give the weights (glm53.sharding: expert_mlp over tp) and what XLA does with the
            # jnp reference. FP8 block scales go with their blocks: a slice must hold whole 128-wide blocks (GLM-5:
            # 2,048 / 16 devices = 128), else FP8 experts take the default path.
            col, row = P(None, None, "tp"), P(None, "tp", None)
            args, specs = [xs, w_gate, w_up, w_down, sizes], [P(), col, col, row, P()]
            if fp8:
                args += [scale["gate"], scale["up"], scale["down"]]
                specs += [col, col, row]

            def local(xs, wg, wu, wd, sizes, *scales):
                s = dict(zip(("gate", "up", "down"), scales)) if scales else scale
                return jax.lax.psum(_experts(xs, wg, wu, wd, sizes, s, kernels), "tp")

            ys = jax.shard_map(local, mesh=mesh, in_specs=tuple(specs), out_specs=P(), check_vma=False)(*args)
        else:
            ys = _experts(xs, w_gate, w_up, w_down, sizes, scale, kernels)
        y = jnp.zeros_like(ys).at[order].set(ys).reshape(n, k, H)
        routed = jnp.einsum("nkh,nk->nh", y.astype(F32), w).astype(x.dtype)
        shared = MLP(c, I * c.n_shared_experts, self.dtype, name="shared_experts")(x)
        return routed.reshape(shape) + shared


class DecoderLayer(nn.Module):
    """``layer`` is the model's layer number (its kind: dense or MoE, own or shared indexer); ``cache_layer`` its
    index in the cache it is given, the same unless the cache holds only some layers (a pipeline stage's cache,
    ``glm53.pipeline``, numbers its layers from the stage's first)."""

    cfg: ModelConfig
    layer: int
    dtype: Any
    cache_layer: int | None = None

    def setup(self):
        c = self.cfg
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, self.dtype)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, self.dtype)
        self.self_attn = MLAttention(c, self.layer, self.dtype, self.cache_layer)
        self.mlp = MoE(c, self.dtype) if c.is_moe_layer(self.layer) else MLP(c, c.intermediate_size, self.dtype)

    def __call__(self, x, step: Step, cache, prev_topk):
        a, cache, topk, round_ = self.self_attn(self.input_layernorm(x), step, cache, prev_topk)
        x = x + a
        x = x + self.mlp(self.post_attention_layernorm(x), step.kernels)
        return x, cache, topk, round_

    def write_kv(self, x, step: Step, cache):
        return self.self_attn.write_kv(self.input_layernorm(x), step, cache)


class GLM5(nn.Module):
    """The whole model. Methods: ``__call__`` (main layers -> final-normed hidden), ``logits``, ``mtp``."""

    cfg: ModelConfig
    dtype: Any = jnp.bfloat16

    def setup(self):
        c = self.cfg
        self.embed_tokens = _weight(self, "embed_tokens", _normal(c), (c.vocab_size, c.hidden_size), self.dtype)
        self.layers = [DecoderLayer(c, i, self.dtype) for i in range(c.num_hidden_layers)]
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, self.dtype)
        if not c.tie_word_embeddings:
            self.lm_head = _weight(self, "lm_head", _normal(c), (c.hidden_size, c.vocab_size), self.dtype)
        if c.num_nextn_predict_layers:
            self.mtp_layer = MTPModule(c, c.num_hidden_layers, self.dtype)

    def __call__(self, tokens: Array, step: Step, cache):
        """Run the main layers on ``tokens [B, T]``; returns (final-normed hidden [B, T, H], cache, rounds)."""
        x = jnp.take(self.embed_tokens, tokens, axis=0)
        topk, rounds = None, []
        for layer in self.layers:
            x, cache, topk, round_ = layer(x, step, cache, topk)
            rounds.append(round_)
        return self.norm(x), cache, rounds

    def logits(self, hidden: Array) -> Array:
        params = {"embed_tokens": self.embed_tokens}
        if not self.cfg.tie_word_embeddings:
            params["lm_head"] = self.lm_head
        return head_logits(hidden, params, self.cfg, self.dtype)

    def mtp(self, hidden: Array, next_tokens: Array, step: Step, cache):
        """MTP module: from a final-normed hidden state at position i and the token at i + 1, the hidden state
        (normed by the shared head's norm) whose logits predict the token at i + 2. ``step`` holds the positions i
        (the MTP layer's rows). Returns (mtp hidden, cache, round)."""
        emb = jnp.take(self.embed_tokens, next_tokens, axis=0)
        return self.mtp_layer(emb, hidden, step, cache)

    def mtp_kv(self, hidden: Array, next_tokens: Array, step: Step, cache):
        """Only the MTP layer's KV rows and indexer keys for the pairs (hidden at i, token at i + 1): what a
        step that processes those tokens owes the MTP layer, without its attention, MLP or head."""
        emb = jnp.take(self.embed_tokens, next_tokens, axis=0)
        return self.mtp_layer.write_kv(emb, hidden, step, cache)


def head_logits(hidden: Array, params: dict, cfg: ModelConfig, dtype) -> Array:
    """The LM head on final-normed hidden states (``params``: the model's ``embed_tokens`` / ``lm_head``)."""
    head = params["embed_tokens"].T if cfg.tie_word_embeddings else params["lm_head"]
    return jnp.dot(hidden.astype(dtype), head.astype(dtype), preferred_element_type=F32)


def _cache_index(module) -> int:
    return module.layer if module.cache_layer is None else module.cache_layer


class MTPModule(nn.Module):
    """DeepSeek-V3-style next-n prediction: eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)]) -> decoder layer ->
    shared_head.norm; the embedding and the LM head are the main model's (the checkpoint's copies are identical).
    Drafting deeper than one token applies the module recursively, its own output hidden state standing in for the
    main model's."""

    cfg: ModelConfig
    layer: int
    dtype: Any
    cache_layer: int | None = None

    def setup(self):
        c = self.cfg
        self.enorm = RMSNorm(c.hidden_size, c.rms_norm_eps, self.dtype)
        self.hnorm = RMSNorm(c.hidden_size, c.rms_norm_eps, self.dtype)
        self.eh_proj = Linear(2 * c.hidden_size, c.hidden_size, c, self.dtype)
        self.block = DecoderLayer(c, self.layer, self.dtype, self.cache_layer)
        self.shared_head_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, self.dtype)

    def _input(self, emb, hidden):
        return self.eh_proj(jnp.concatenate([self.enorm(emb), self.hnorm(hidden.astype(emb.dtype))], axis=-1))

    def __call__(self, emb, hidden, step, cache):
        x, cache, _, round_ = self.block(self._input(emb, hidden), step, cache, None)
        return self.shared_head_norm(x), cache, round_

    def write_kv(self, emb, hidden, step, cache):
        return self.block.write_kv(self._input(emb, hidden), step, cache)
