"""int4 scales held in f32, under --load-format gemma_qat only.
Upstream patch: patches/0014-* (write-up: patches/README.md).

tokamax's `gmm_v2` reads its per-group scales in f32; tpu-inference 0.32's
wNa16 method keeps them as the checkpoint stores them (bf16), so every int4
call of every step first converts them: an XLA `convert` fusion per call
that reads the bf16 scales and writes f32 ones (E2B: ~59 M scales, ~352 MB
of HBM traffic a step; ~0.43 ms on a v5e by arithmetic). Converted once,
when the weights are processed: the same values (every bf16 is an f32),
+2 bytes per 32 weights (E2B +118 MB). What the TPU compiler says
(benchmarks/README.md, E2B v5e-1): the step's XLA part 3.25 -> 2.93 ms at
16 tokens, 17.30 -> 15.81 ms at 512 (bf16's: 8.28 / 16.54).

Only the kernel's layout ([in / group, 1, out]) is changed; the XLA path
(a 2-D scale) takes its scale as it is.
"""
from __future__ import annotations

import functools

from vllm_gemma_qat import substitute
from vllm_gemma_qat.gate import LOAD_FORMAT, is_gemma_qat
from vllm_gemma_qat.substitute import Substitution

WNA16_MODULE = "tpu_inference.layers.jax.quantization.wna16"


def install() -> None:
    substitute.apply_on_import(
        WNA16_MODULE, substitutions,
        f"vllm-gemma-qat (--load-format {LOAD_FORMAT} only, int4 scales)")


def substitutions() -> list[Substitution]:
    return [Substitution(
        f"{WNA16_MODULE}:WNA16LinearMethod.process_weights_after_loading",
        _f32_scales,
        "gmm_v2's int4 scales held in f32 (the dtype it reads), not "
        "converted from bf16 by every call of every step", wraps=True)]


def _f32_scales(process_weights_after_loading):

    @functools.wraps(process_weights_after_loading)
    def process(self, layer):
        done = process_weights_after_loading(self, layer)
        if done and self.use_kernel and _serving_gemma_qat():
            import jax.numpy as jnp
            layer.weight_scale.value = layer.weight_scale.value.astype(
                jnp.float32)
        return done

    return process


def _serving_gemma_qat() -> bool:
    # vLLM sets the config while the runner loads the model; a load outside
    # it (a script, tpu-inference's own tests) is not gemma_qat's.
    from vllm.config import get_current_vllm_config_or_none
    return is_gemma_qat(get_current_vllm_config_or_none())
