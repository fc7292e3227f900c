"""MoE experts kept in FP8 on the device (e4m3 + one scale per 128 x 128 block, dequantised inside the grouped
matmul): on the CPU bit-identical to the same weights dequantised beforehand (on a GPU the compiled kernel's summation
order may differ: tests/test_kernels_moe.py), from random init, from an FP8 HF checkpoint (whose bytes are kept as
they are) and through a native save / load."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.traverse_util import flatten_dict, unflatten_dict
from safetensors.numpy import save_file

import glm53
from glm53.params import expert_weights_of
from kernels_pallas.grouped_matmul import dequantize_blocks, quantize_blocks
from tests.engine_common import CFG, CC, ids

sys.path.insert(0, os.path.dirname(__file__))
from hf_reference import write_fp8_checkpoint, write_tiny_checkpoint  # noqa: E402

ON_GPU = jax.default_backend() in ("gpu", "cuda", "rocm")


def assert_same(a, b):
    """Bit-identical on the CPU; on a GPU the compiled kernel's summation order for FP8 operands may differ."""
    if ON_GPU:
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-2, atol=1e-2)
    else:
        np.testing.assert_array_equal(a, b)


def dequantised(params, dtype):
    """The same parameters with every FP8 expert stack dequantised to ``dtype`` and its scales dropped."""
    flat = dict(flatten_dict(params))
    for path in [p for p in flat if str(p[-1]).endswith("_proj_scale")]:
        scale = flat.pop(path)
        w = path[:-1] + (path[-1][: -len("_scale")],)
        flat[w] = dequantize_blocks(flat[w], scale, dtype)
    return unflatten_dict(flat)


@pytest.mark.parametrize("kernels", ["reference", "pallas"])
def test_random_fp8_experts_equal_their_dequantised_weights(kernels):
    fp8 = glm53.from_config(CFG, seed=7, dtype="bfloat16", expert_weights="fp8")
    assert fp8.expert_weights == "fp8" and "fp8 experts" in repr(fp8)
    deq = glm53.Model(CFG, dequantised(fp8.params, jnp.bfloat16), "bfloat16")
    assert deq.expert_weights == "model"
    cc = CC.replace(kv_format="bf16", mode="offload")
    a = glm53.generate(fp8, [ids(40, 1)], max_new_tokens=6, cache=cc, return_logits=True, kernels=kernels)
    b = glm53.generate(deq, [ids(40, 1)], max_new_tokens=6, cache=cc, return_logits=True, kernels=kernels)
    if not ON_GPU:
        assert a.tokens == b.tokens
    assert_same(a.logits, b.logits)
    # and the experts are really stored as e4m3: half the bytes of the bf16 stacks
    flat = flatten_dict(fp8.params)
    stacks = [v for p, v in flat.items() if str(p[-1]).startswith("experts_") and str(p[-1]).endswith("_proj")]
    assert stacks and all(v.dtype == jnp.float8_e4m3fn for v in stacks)


def test_fp8_checkpoint_kept_as_fp8_equals_dequantised_on_load(tmp_path):
    tensors = write_fp8_checkpoint(str(tmp_path))
    on_load = glm53.from_pretrained(str(tmp_path), dtype="float32", kv_format="f32")
    kept = glm53.from_pretrained(str(tmp_path), dtype="float32", kv_format="f32", expert_weights="fp8")
    assert on_load.expert_weights == "model" and kept.expert_weights == "fp8"
    # the checkpoint's own e4m3 bytes and scales, transposed to glm53's [in, out] layout
    w = kept.params["layers_1"]["mlp"]["experts_gate_proj"]
    s = kept.params["layers_1"]["mlp"]["experts_gate_proj_scale"]
    src = tensors["model.layers.1.mlp.experts.3.gate_proj.weight"]
    np.testing.assert_array_equal(np.asarray(w[3]).view(np.uint8), np.asarray(src).T.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(s[3]), tensors["model.layers.1.mlp.experts.3.gate_proj.weight_scale_inv"].T)
    # dequantised on load (the non-expert o_proj too) vs kept: the same logits, bit for bit
    prompt = np.random.default_rng(0).integers(0, 256, 40)
    assert_same(kept.forward(prompt), on_load.forward(prompt))
    with pytest.raises(ValueError, match="expert_weights must be one of"):
        glm53.from_pretrained(str(tmp_path), expert_weights="int4")


def test_fp8_experts_survive_native_save_and_load(tmp_path):
    fp8 = glm53.from_config(CFG, seed=7, dtype="bfloat16", expert_weights="fp8")
    fp8.save(str(tmp_path / "m"))
    back = glm53.load(str(tmp_path / "m"))
    assert back.expert_weights == "fp8"
    for (pa, a), (pb, b) in zip(jax.tree_util.tree_leaves_with_path(fp8.params),
                                jax.tree_util.tree_leaves_with_path(back.params)):
        assert pa == pb and a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert expert_weights_of(back.params) == "fp8"


def test_fp8_weights_meet_their_scales_across_shards_and_are_checked(tmp_path):
    """Published FP8 checkpoints are sharded, and a weight's block scale may lie in another shard than the weight:
    both expert modes load the same parameters as from one file. A weight without its scale, a scale of the wrong
    shape or another block size is refused, naming the tensor: the raw e4m3 values would otherwise load unscaled."""
    import json

    one = tmp_path / "one"
    tensors = write_fp8_checkpoint(str(one))
    sharded = tmp_path / "sharded"
    os.makedirs(sharded)
    for f in os.listdir(one):
        if f != "model.safetensors":
            (sharded / f).write_bytes((one / f).read_bytes())
    shards = {"weights.safetensors": {n: t for n, t in tensors.items() if not n.endswith("_scale_inv")},
              "scales.safetensors": {n: t for n, t in tensors.items() if n.endswith("_scale_inv")}}
    for f, part in shards.items():
        save_file(part, str(sharded / f), metadata={"format": "pt"})
    (sharded / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {n: f for f, part in shards.items() for n in part}}))
    for mode in ("model", "fp8"):
        a = glm53.from_pretrained(str(one), dtype="float32", expert_weights=mode)
        b = glm53.from_pretrained(str(sharded), dtype="float32", expert_weights=mode)
        for x, y in zip(jax.tree_util.tree_leaves(a.params), jax.tree_util.tree_leaves(b.params)):
            np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))

    def rewrite(edit):
        t = dict(shards["scales.safetensors"])
        edit(t)
        save_file(t, str(sharded / "scales.safetensors"), metadata={"format": "pt"})
        index = {"weight_map": {**{n: "weights.safetensors" for n in shards["weights.safetensors"]},
                                **{n: "scales.safetensors" for n in t}}}
        (sharded / "model.safetensors.index.json").write_text(json.dumps(index))

    o_proj = "model.layers.2.self_attn.o_proj.weight"
    rewrite(lambda t: t.pop(o_proj + "_scale_inv"))
    with pytest.raises(glm53.CheckpointError, match=rf"{o_proj} is F8_E4M3 \(FP8\) but the checkpoint has no "
                                                    rf"{o_proj}_scale_inv"):
        glm53.from_pretrained(str(sharded), dtype="float32")
    expert = "model.layers.1.mlp.experts.3.gate_proj.weight"
    rewrite(lambda t: t.update({expert + "_scale_inv": np.ones((2, 2), np.float32)}))
    with pytest.raises(glm53.CheckpointError, match=rf"{expert}_scale_inv: shape \(2, 2\), but .* needs \(1, 1\)"):
        glm53.from_pretrained(str(sharded), dtype="float32", expert_weights="fp8")
    rewrite(lambda t: None)
    cfg = json.loads((sharded / "config.json").read_text())
    (sharded / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"weight_block_size": [64, 64]}}))
    with pytest.raises(glm53.CheckpointError, match=r"weight_block_size=\[64, 64\]"):
        glm53.from_pretrained(str(sharded), dtype="float32")
