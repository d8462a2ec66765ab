"""Run in a subprocess with a patched tpu-inference copy first on sys.path.

    python upstream_check.py stock <ckpt>...   # stock `auto`, plugin not loaded
                                               # (+ the last one in bfloat16)
    python upstream_check.py plugin <ckpt>...  # gemma_qat with the plugin
                                               # (+ whether it sees 0008)

A checkpoint directory is named GEOMETRY-LAYOUT (tests/test_upstream_patch.py);
layout "bare": QAT, the text-only model as transformers saves it.

Prints one line per checkpoint; exits non-zero on the first failure.
"""
import logging
import sys

import numpy as np
from vllm.plugins import load_general_plugins

from vllm_gemma_qat import cpu
from vllm_gemma_qat.testing import runner, tiny


def main(mode, paths):
    logging.basicConfig(level=logging.INFO)  # as vLLM's engine processes do
    load_general_plugins()
    from tpu_inference.models.common import kv_share
    assert hasattr(kv_share, "skip_kv_shared_layer_weights"), kv_share.__file__
    plugin_loaded = "vllm_gemma_qat.fixes.kv_share" in sys.modules
    assert plugin_loaded == (mode == "plugin"), plugin_loaded
    for path in paths:
        geometry, layout = path.rsplit("/", 1)[-1].split("-")
        multimodal = geometry == "e2b"
        load_format = "gemma_qat" if mode == "plugin" else "auto"
        model, config, mesh = runner.load(path, load_format)
        text = config.model_config.hf_text_config
        from tpu_inference.models.common.kv_share import compute_kv_share_map
        lm = (model.model.model.language_model if multimodal else
              model.model.language_model)
        for i in compute_kv_share_map(text):
            attn = lm.layers[i].self_attn
            assert attn.k_proj is None and attn.v_proj is None, (i, attn.k_proj)
            assert attn.k_norm is None
        hf = tiny.build_model(geometry, multimodal)
        prompt = list(np.random.RandomState(0).randint(3, 500, size=21))
        import torch
        with torch.no_grad():
            ref = hf(input_ids=torch.tensor([prompt])).logits[0].numpy()
        with cpu.kernels():
            got = runner.PagedRunner(model, config, mesh).step(prompt)
        diff = float(np.abs(got - ref).max())
        assert diff < 1e-4, diff
        print(f"ok {mode} {load_format} {geometry} {layout} max|dlogit|={diff:.2e}")
    if mode == "stock":
        check_served_in_bfloat16(paths[-1], prompt, hf, ref)
    else:  # does the plugin's sliding-window fix see upstream's packing?
        from vllm_gemma_qat.fixes import sliding_window
        print("packs", sliding_window._upstream_packs())


def check_served_in_bfloat16(path, prompt, hf, ref):
    """The float32 checkpoint under --dtype bfloat16 (vLLM's default for a
    float32 model): every floating-point weight is bfloat16 and a step runs
    against a bfloat16 KV cache (0.32.0 kept float32 weights, and the
    attention's dtype check failed at the first request). Its logits drift
    from transformers' float32 ones (`ref`, `hf`'s) by no more than twice
    (root mean square) what transformers' own bfloat16 run drifts."""
    import copy

    import torch
    import jax
    import jax.numpy as jnp
    model, config, mesh = runner.load(path, "auto", dtype="bfloat16")
    dtypes = {str(leaf.dtype) for leaf in jax.tree.leaves(model.state_leaves)
              if jnp.issubdtype(leaf.dtype, jnp.floating)}
    assert dtypes == {"bfloat16"}, dtypes
    with cpu.kernels():
        logits = runner.PagedRunner(model, config, mesh).step(prompt)
    with torch.no_grad():
        same = copy.deepcopy(hf).to(torch.bfloat16)(
            input_ids=torch.tensor([prompt])).logits[0].float().numpy()

    def rms(x):
        return float(np.sqrt(np.mean(np.square(x))))

    drift, reference = rms(logits - ref), rms(same - ref)
    assert 0 < drift <= 2 * reference, (drift, reference)
    print(f"ok stock bfloat16 from float32 {path.rsplit('/', 1)[-1]} "
          f"rms|dlogit|={drift:.2e} (transformers bf16 {reference:.2e})")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
