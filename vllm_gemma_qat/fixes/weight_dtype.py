"""Floating-point weights loaded in the served dtype, under --load-format
gemma_qat (applied by the loader's `WeightFeed` as it hands tensors over).
Upstream patch: patches/0005-* (write-up: patches/README.md).

tpu-inference 0.32's JAX loader (`JaxAutoWeightsLoader`) keeps each tensor's
checkpoint dtype, so a float32 checkpoint under --dtype bfloat16 gave
float32 K/V that the bf16 KV cache refused, killing the engine at its first
request. Here every other floating-point tensor is cast to vLLM's --dtype;
integer tensors, and the int4 pack-quantized tensors and their scales, stay
as stored (their quantization method chooses their dtype).
"""
from __future__ import annotations

from vllm_gemma_qat.quantization import PACKED_SUFFIXES


def served_dtype(dtype):
    """vLLM's --dtype as torch's (tpu-inference may give a JAX dtype); None
    (no cast) stays None."""
    import torch
    if dtype is not None and not isinstance(dtype, torch.dtype):
        from tpu_inference.utils import to_torch_dtype
        dtype = to_torch_dtype(dtype)
    return dtype


def in_served_dtype(name: str, tensor, dtype):
    """The checkpoint tensor `name` as the model is to hold it; `dtype` from
    `served_dtype`."""
    if (dtype is None or not tensor.is_floating_point()
            or tensor.dtype == dtype
            or name.endswith(PACKED_SUFFIXES)):  # int4 scales stay as stored
        return tensor
    return tensor.to(dtype)
