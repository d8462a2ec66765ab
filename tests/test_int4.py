"""Exact int4: grid recovery, packing, and both QAT int4 exports loaded
through gemma_qat into tpu-inference's wNa16 path (CPU; tokamax's TPU-only
gmm_v2 replaced by CPU mode's vllm_gemma_qat/cpu/gmm.py, itself checked
against tokamax's own reference)."""
import re
import shutil

import ml_dtypes
import numpy as np
import pytest
import torch

import harness
from vllm_gemma_qat import checkpoint, cpu, geometry, int4, quantization
from vllm_gemma_qat.checkpoint import CheckpointError
from vllm_gemma_qat.cpu import gmm as cpu_gmm
from vllm_gemma_qat.testing import runner, tiny

BF16 = ml_dtypes.bfloat16
# Both sides use the same exact weights (fp32 activations, q * d exact), so
# only summation order differs; a nibble-order, offset or scale bug moves
# logits by ~1e-1.
LOGIT_ATOL = 1e-4


# --- the matmul stand-in ----------------------------------------------------

def test_cpu_gmm_matches_tokamax_reference():
    import jax
    import jax.numpy as jnp
    from tokamax._src.ops.experimental.gmm_v2.gmm_v2_test import reference_gmm
    k0, k1, k2 = jax.random.split(jax.random.key(0), 3)
    lhs = jax.random.normal(k0, (19, 256), jnp.bfloat16)
    rhs = jax.random.randint(k1, (2, 256, 96), -8, 8).astype(jnp.int4)
    scale = jax.random.uniform(k2, (2, 8, 1, 96), jnp.float32).astype(
        jnp.bfloat16)
    for group_sizes in ([19, 0], [7, 12], [4, 9], [0, 19]):
        group_sizes = jnp.array(group_sizes, jnp.int32)
        want = reference_gmm(lhs, rhs, group_sizes, rhs_scale=scale)
        got = cpu_gmm.gmm(lhs, rhs, group_sizes, rhs_scale=scale,
                          preferred_element_type=jnp.bfloat16,
                          maybe_quantize_lhs=False)
        rows = int(group_sizes.sum())  # the reference stops there
        np.testing.assert_array_equal(np.asarray(got, np.float32)[:rows],
                                      np.asarray(want, np.float32))


# --- grid recovery ----------------------------------------------------------

def _grid(rng, rows=64, cols=256, scale="bf16"):
    q = rng.integers(-8, 8, size=(rows, cols)).astype(np.int8)
    g = q.reshape(rows, -1, 32)
    g[0, 0] = np.clip(g[0, 0], -5, 5)            # peak at level 5
    g[0, 1] = np.abs(g[0, 1]) % 8                # positive peak at 7
    g[1, 0] = -np.abs(g[1, 0])                   # negative peak at -8
    g[1, 1] = 0                                  # all-zero group
    g[2, 0] = np.clip(g[2, 0], -3, 3)            # peak at level 3
    g[2, 1] = (g[2, 1] // 4) * 4                 # levels 0, +-4, -8 only
    d = rng.uniform(1e-3, 2e-2, size=g.shape[:2])
    d = d.astype(np.float16 if scale == "fp16" else BF16)
    w = (g.astype(np.float32) * d.astype(np.float32)[..., None])
    return q, d, w.reshape(rows, cols).astype(BF16)


def test_recover_grid_is_bit_exact_on_grid():
    q, d, w = _grid(np.random.default_rng(0))
    q2, d2 = int4.recover_grid(w, "w")
    np.testing.assert_array_equal(int4.dequantize(q2, d2).view(np.uint16),
                                  w.view(np.uint16))
    assert (q2[1, 32:64] == 0).all() and (d2[1, 1] == 0)
    assert q2.min() >= -8 and q2.max() <= 7


def test_recover_grid_finds_levels_other_than_8():
    q, d, w = _grid(np.random.default_rng(1))
    q2, d2 = int4.recover_grid(w, "w")
    # Groups peaking at 5, +7 and 3: the textbook d = max|w| / 8 does not
    # reproduce them; the searched level does, bit-exact in bf16.
    for row, group in ((0, 0), (0, 1), (2, 0)):
        cols = slice(group * 32, (group + 1) * 32)
        wg = w[row, cols].astype(np.float32)
        naive_d = np.abs(wg).max() / 8
        naive = np.clip(np.rint(wg / naive_d), -8, 7) * naive_d
        assert not np.array_equal(naive.astype(BF16), w[row, cols])
        exact = q2[row, cols].astype(np.float32) * np.float32(d2[row, group])
        np.testing.assert_array_equal(exact.astype(BF16), w[row, cols])


def test_recover_grid_fp16_scales_within_one_bf16_ulp():
    # GGML q4_0 keeps d in fp16; its bf16 export is bf16(q * d_fp16).
    q, d, w = _grid(np.random.default_rng(2), scale="fp16")
    q2, d2 = int4.recover_grid(w, "w")
    got = q2.reshape(64, -1, 32) * d2.astype(np.float32)[..., None]
    want = w.astype(np.float32).reshape(64, -1, 32)
    ulp = 2.0**(np.floor(np.log2(np.maximum(np.abs(want), 1e-30))) - 7)
    assert (np.abs(got - want) <= ulp).all()


def test_recover_grid_takes_ggml_negative_scales():
    # GGML's q4_0 puts the signed peak on level -8: d < 0 for a positive peak.
    rng = np.random.default_rng(5)
    q = rng.integers(-8, 8, size=(16, 64)).astype(np.int8)
    q[:, ::32] = -8
    d = -rng.uniform(1e-3, 2e-2, size=(16, 2)).astype(BF16)
    w = int4.dequantize(q, d)
    assert (w.astype(np.float32).reshape(16, 2, 32).max(-1) > 0).all()
    q2, d2 = int4.recover_grid(w, "w")
    np.testing.assert_array_equal(int4.dequantize(q2, d2).view(np.uint16),
                                  w.view(np.uint16))


def test_off_grid_tensor_raises_naming_tensor_and_group():
    _, _, w = _grid(np.random.default_rng(3))
    w[5, 70] = BF16(float(w[5, 70]) * 1.37 + 1e-3)
    with pytest.raises(int4.OffGridError,
                       match=r"layers\.3\.mlp\.up_proj\.weight: 1 group\(s\) off "
                       r"the int4 grid, first row 5 group 2 \(columns 64:96\)"):
        int4.recover_grid(w, "model.language_model.layers.3.mlp.up_proj.weight")


# --- packing, against independent implementations ----------------------------

def test_pack_matches_compressed_tensors_and_tpu_inference_unpack():
    import jax.numpy as jnp
    from compressed_tensors.compressors.pack_quantized.helpers import (
        pack_to_int32, unpack_from_int32)
    from tpu_inference.layers.common.quantization import u32_unpack_i4
    q = np.random.default_rng(4).integers(-8, 8, size=(48, 96)).astype(np.int8)
    packed = int4.pack_int4(q)
    assert packed.dtype == np.int32 and packed.shape == (48, 12)
    np.testing.assert_array_equal(packed,
                                  pack_to_int32(torch.from_numpy(q), 4).numpy())
    np.testing.assert_array_equal(
        unpack_from_int32(torch.from_numpy(packed), 4,
                          torch.Size(q.shape)).numpy(), q)
    np.testing.assert_array_equal(
        np.asarray(u32_unpack_i4(jnp.asarray(packed)), np.int8), q)
    np.testing.assert_array_equal(int4.unpack_int4(packed, 96), q)


# --- loading both exports through gemma_qat ----------------------------------

@pytest.fixture(scope="module")
def int4_model():
    hf = tiny.build_model("e2b", multimodal=True, seed=3)
    grid = tiny.put_on_int4_grid(hf)
    return hf, grid


PLMP = "model.language_model.per_layer_model_projection"
# (form, extra ignore): Google's recipe packs per_layer_model_projection too;
# a variant keeps it bf16. The set must follow the checkpoint either way.
FORMS = {"w4a16": ("w4a16", ()),
         "w4a16-plmp-bf16": ("w4a16", ("re:.*per_layer_model_projection.*", )),
         "q4_0": ("q4_0", ())}


@pytest.fixture(scope="module")
def int4_checkpoints(int4_model, tmp_path_factory):
    hf, grid = int4_model
    root = tmp_path_factory.mktemp("int4")
    return {name: tiny.save_int4_checkpoint(hf, root / name, grid, form,
                                            ignore=ignore)
            for name, (form, ignore) in FORMS.items()}


def _load(form, path, overrides=None):
    if form == "q4_0" and overrides is None:
        overrides = {"quantization_config":
                     quantization.w4a16_quantization_config()}
    return runner.load(path, "gemma_qat", hf_overrides=overrides)


def _int4_modules(model) -> set[str]:
    """Checkpoint module names of the model's int4 weights (tpu-inference
    fuses gate_proj + up_proj into gate_up_proj)."""
    out = set()
    lm = model.model.model.language_model
    for name, param in lm.named_parameters():
        if name.endswith(".weight") and str(param[...].dtype) == "int4":
            module = "model.language_model." + name.removesuffix(".weight")
            if module.endswith(".gate_up_proj"):
                base = module.removesuffix("gate_up_proj")
                out |= {base + "gate_proj", base + "up_proj"}
            else:
                out.add(module)
    return out


def _linear_int4_ratio(model):
    """(int4 weight + scale) bytes over bf16 bytes, LM linears, and the
    scales' dtypes."""
    int4_bytes = bf16_bytes = 0
    scale_dtypes = set()
    layers = model.model.model.language_model.layers
    for layer in layers:
        for name, param in layer.named_parameters():
            if name.endswith(".weight") and str(param[...].dtype) == "int4":
                scale = dict(layer.named_parameters())[name + "_scale"][...]
                scale_dtypes.add(str(scale.dtype))
                int4_bytes += param[...].size // 2 + scale.nbytes
                bf16_bytes += param[...].size * 2
    return int4_bytes / bf16_bytes, bf16_bytes, scale_dtypes


@pytest.mark.parametrize("name", FORMS)
def test_int4_export_loads_and_matches_transformers(plugin, int4_model,
                                                    int4_checkpoints, name):
    hf, grid = int4_model
    form, ignore = FORMS[name]
    path = int4_checkpoints[name]
    report = geometry.check(checkpoint.open_checkpoint(path))
    model, config, mesh = _load(form, path)
    lm = model.model.model.language_model
    # The int4 set is the checkpoint's (w4a16: its packed modules; q4_0: what
    # the overrides select), per_layer_model_projection included or not.
    linears = set(report.geometry.linear_modules(report.prefix))
    want = set(report.quantized) if form == "w4a16" else linears
    assert _int4_modules(model) == want
    assert (PLMP in want) == (not ignore)
    assert str(lm.embed_tokens.weight[...].dtype) != "int4"
    assert all(str(p[...].dtype) != "int4"
               for _, p in model.model.model.vision_tower.named_parameters())
    # Shared layers still own no K/V.
    assert lm.layers[5].self_attn.k_norm is None
    # 4 bits a weight and an f32 scale per 32 (fixes/int4_scales.py): the
    # kernel's scales are held in the dtype it reads.
    ratio, bf16_bytes, scale_dtypes = _linear_int4_ratio(model)
    assert scale_dtypes == {"float32"}
    assert ratio == pytest.approx(0.3125) and bf16_bytes > 0
    prompt = list(np.random.RandomState(0).randint(3, 500, size=21))
    with cpu.kernels():
        got = runner.PagedRunner(model, config, mesh).step(prompt)
    np.testing.assert_allclose(got, harness.hf_logits(hf, prompt),
                               atol=LOGIT_ATOL, rtol=0)


def test_int4_loads_catch_a_wrong_nibble_order(plugin, int4_model,
                                               int4_checkpoints, monkeypatch):
    # The tolerance above is tight enough to see a real packing bug.
    hf, _ = int4_model
    original = int4.pack_int4  # the 8 nibbles of each word in reverse order:
    monkeypatch.setattr(int4, "pack_int4", lambda q: original(
        q.reshape(q.shape[0], -1, 8)[..., ::-1].reshape(q.shape).copy()))
    model, config, mesh = _load("q4_0", int4_checkpoints["q4_0"])
    prompt = list(np.random.RandomState(0).randint(3, 500, size=21))
    with cpu.kernels():
        got = runner.PagedRunner(model, config, mesh).step(prompt)
    assert np.abs(got - harness.hf_logits(hf, prompt)).max() > 100 * LOGIT_ATOL


def _edited_copy(src, dst, edit):
    """A copy of checkpoint `src` whose tensors went through `edit`."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    shard = dst / "model.safetensors"
    tensors = load_file(shard)
    edit(tensors)
    save_file(tensors, shard, metadata={"format": "pt"})
    return dst


def _push_off_grid(name):
    def edit(tensors):
        tensors[name][3, 40] = tensors[name][3, 40] * 1.37 + 1e-3
    return edit


def test_q4_0_off_grid_weight_is_named(plugin, int4_checkpoints, tmp_path):
    name = "model.language_model.layers.2.mlp.down_proj.weight"
    path = _edited_copy(int4_checkpoints["q4_0"], tmp_path / "q4",
                        _push_off_grid(name))
    with pytest.raises(int4.OffGridError, match=rf"{re.escape(name)}: 1 group"):
        _load("q4_0", path)


def test_w4a16_missing_scale_is_named_not_a_jax_type_error(
        plugin, int4_checkpoints, tmp_path):
    name = "model.language_model.layers.4.self_attn.o_proj.weight_scale"
    path = _edited_copy(int4_checkpoints["w4a16"], tmp_path / "ct",
                        lambda tensors: tensors.pop(name))
    with pytest.raises(CheckpointError, match=rf"missing tensor {re.escape(name)}"):
        _load("w4a16", path)


def _edit_config(path, edit):
    import json
    file = path / "config.json"
    config = json.loads(file.read_text())
    edit(config["quantization_config"])
    file.write_text(json.dumps(config))


def test_w4a16_config_disagreeing_with_tensors_names_the_module(
        plugin, int4_checkpoints, tmp_path):
    # Checkpoint keeps per_layer_model_projection bf16, config quantizes it.
    bf16_plmp = tmp_path / "a"
    shutil.copytree(int4_checkpoints["w4a16-plmp-bf16"], bf16_plmp)
    _edit_config(bf16_plmp, lambda q: q.update(ignore=list(
        quantization.W4A16_IGNORE)))
    with pytest.raises(CheckpointError,
                       match=rf"quantization_config quantizes {PLMP}, but the "
                       rf"checkpoint holds it as bf16 {PLMP}\.weight"):
        _load("w4a16", bf16_plmp)
    # Checkpoint packs it, config ignores it.
    packed_plmp = tmp_path / "b"
    shutil.copytree(int4_checkpoints["w4a16"], packed_plmp)
    _edit_config(packed_plmp,
                 lambda q: q["ignore"].append(PLMP))
    report = geometry.check(checkpoint.open_checkpoint(packed_plmp))
    assert not report.loads_with_gemma_qat
    assert report.inconsistent == [
        f"{PLMP} is pack-quantized in the checkpoint, but quantization_config "
        "does not quantize it (targets ['Linear'], ignore "
        f"{list(quantization.W4A16_IGNORE) + [PLMP]})"]


def test_int4_overrides_for_a_checkpoint_keeps_off_grid_modules_bf16(
        plugin, int4_checkpoints, tmp_path, capsys):
    import json

    from vllm_gemma_qat import cli
    off = "model.language_model.layers.2.mlp.up_proj"
    path = _edited_copy(int4_checkpoints["q4_0"], tmp_path / "q4",
                        _push_off_grid(off + ".weight"))
    capsys.readouterr()
    # `vllm-gemma-qat int4-overrides PATH`, in this process.
    returncode = cli.main(["int4-overrides", str(path)])
    out = capsys.readouterr()
    assert returncode == 0, out.err
    gate = off.removesuffix("up_proj") + "gate_proj"
    assert re.search(rf"stays bf16: {re.escape(off)}\.weight: 1 group\(s\) "
                     r"off the int4 grid, first row 3 group 1", out.err)
    assert f"stays bf16: {gate} (fused with" in out.err
    overrides = json.loads(out.out)
    assert overrides["quantization_config"]["ignore"][-2:] == [off, gate]
    model, config, mesh = _load("q4_0", path, overrides)
    report = geometry.check(checkpoint.open_checkpoint(path))
    linears = set(report.geometry.linear_modules(report.prefix))
    assert _int4_modules(model) == linears - {off, gate}
    # The bf16 gate/up pair computes what transformers computes from the
    # edited checkpoint.
    from transformers import Gemma4ForConditionalGeneration
    hf = Gemma4ForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32).eval()
    prompt = list(np.random.RandomState(0).randint(3, 500, size=21))
    with cpu.kernels():
        got = runner.PagedRunner(model, config, mesh).step(prompt)
    np.testing.assert_allclose(got, harness.hf_logits(hf, prompt),
                               atol=LOGIT_ATOL, rtol=0)
