"""int4 linears compile to less TPU code, under --load-format gemma_qat only.
Upstream patch: patches/0013-* (write-up: patches/README.md).

tpu-inference 0.32 runs every wNa16 linear through tokamax's `gmm_v2`
(`sharded_quantized_matmul`), with the tiles its `_safe_calculate_tiling`
picks. The kernel's body is unrolled over the weight tile, one matmul per
MXU-sized block (tile_k x tile_n / MXU width^2; ~2 KiB of code each on a
v5e), compiled for each k-step case and once per M "bucket" (tokamax grows
tile_m to up to four times its base and keeps a branch per multiple).
Every call site gets its own copy (XLA shares none), and tokamax takes the
whole N and K where they fit VMEM: E2B's KV-shared gate_up is one tile of
1,536 x 24,576, 2,304 v5e blocks. Gemma 4 E2B's step has 241 calls: the
int4 512-token step carries 260 MiB of code on v6e-1 (bf16: 21 MiB) and
does not fit a v5e-1 at default flags (`CompileTimeHbmOom`, 205 MB over;
E4B 834 MB; benchmarks/README.md); the 16-token step 105 MiB on v5e-1.

Under gemma_qat (the rule: `int4_tiles.py`), decided per call:

- One M bucket (bucket_base = tile_m). The smaller buckets serve only a
  last tile the tokens do not fill; tpu-inference's token buckets are powers
  of two (up to --max-num-batched-tokens), multiples of tile_m, so those
  branches never run: the same work, a quarter of the code. A token count
  that is not a multiple computes its last tile whole, masked as before.
- N tiles (whole lanes, dividing N) that keep a weight tile within 128 MXU
  blocks (v5e: 2^21 int4 values, 1 MiB; v6e: 2^23), at every step size;
  from M >= 256 tokens also within max(4 M, 2 MXU widths) columns (each N
  tile reads the step's activations again, M x K x 2 bytes, against its
  weights' N_tile x K / 2). More N tiles are more grid steps, each with its
  overhead, but each tile's weight DMA can then overlap the previous one's
  compute (one grid step overlaps none).

What the TPU compiler says (libtpu, deviceless; benchmarks/README.md): the
int4 steps of full-size E2B and E4B carry at most 1.6x the code of bf16's
at each token bucket on v5e-1, v6e-1 and v6e-4 (E2B v5e-1, 16 tokens:
104.9 -> 11.3 MiB; bf16 9.2), and every one fits at default flags. XLA's cost
estimate for the kernel is the kernel's own declaration, blind to tiling:
run-time cost on a TPU is not measured (`benchmarks/tpu_kernels.py` times
the tilings on the first TPU it is run on).

Decided per engine process: tpu-inference's JAX model build
(`get_flax_model`) says whether the model it builds serves gemma_qat
(tracing happens after).
"""
from __future__ import annotations

import functools

from vllm_gemma_qat import substitute
from vllm_gemma_qat.fixes import int4_tiles
from vllm_gemma_qat.gate import LOAD_FORMAT, is_gemma_qat
from vllm_gemma_qat.substitute import Substitution

LINEAR_MODULE = "tpu_inference.layers.common.linear"
MODEL_LOADER = "tpu_inference.models.common.model_loader"
_serving_gemma_qat = False


def install() -> None:
    label = f"vllm-gemma-qat (--load-format {LOAD_FORMAT} only, int4 tiles)"
    substitute.apply_on_import(LINEAR_MODULE, linear_substitutions, label)
    substitute.apply_on_import(MODEL_LOADER, loader_substitutions, label)


def linear_substitutions() -> list[Substitution]:
    return [Substitution(
        f"{LINEAR_MODULE}:_safe_calculate_tiling", _compact,
        "gmm_v2 tiles with one M bucket and N tiles bounded (weight tiles "
        "of at most 128 MXU blocks; prefill: max(4 M, 2 widths) columns): "
        "less generated code per int4 linear",
        wraps=True)]


def loader_substitutions() -> list[Substitution]:
    # get_model (the runner's and compile's entry) builds JAX models here,
    # through the module's own name: the target's and the drafter's.
    return [Substitution(
        f"{MODEL_LOADER}:get_flax_model", _noting_gemma_qat,
        "the JAX model build says whether the model serves gemma_qat",
        wraps=True)]


def substitutions() -> list[Substitution]:
    return linear_substitutions() + loader_substitutions()


def _compact(safe_calculate_tiling):

    @functools.wraps(safe_calculate_tiling)
    def tiling(dims, lhs_cfgs, rhs_cfgs, vmem_limit_bytes, fuse_act=None):
        tiles = safe_calculate_tiling(dims, lhs_cfgs, rhs_cfgs,
                                      vmem_limit_bytes, fuse_act)
        if (not _serving_gemma_qat or fuse_act is not None
                or dims.size_group != 1):  # dense linears only
            return tiles
        return int4_tiles.for_the_chip(tiles, dims)

    return tiling


def _noting_gemma_qat(get_flax_model):

    @functools.wraps(get_flax_model)
    def wrapped(vllm_config, *args, **kwargs):
        global _serving_gemma_qat
        _serving_gemma_qat = is_gemma_qat(vllm_config)
        return get_flax_model(vllm_config, *args, **kwargs)

    return wrapped
