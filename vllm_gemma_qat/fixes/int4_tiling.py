"""int4 linears compile to less TPU code, under --load-format gemma_qat only.
Upstream patch: patches/0013-* (write-up: patches/README.md).

tpu-inference 0.32 runs every wNa16 linear through tokamax's `gmm_v2`
(`sharded_quantized_matmul`), with the tiles its `_safe_calculate_tiling`
picks. The kernel unrolls its body over the tile's N columns (one matmul per
MXU width), compiles it for four K-step cases (first / middle / last / both)
and once per M "bucket" (tokamax grows tile_m to up to four times its base
and keeps a branch per multiple). Every call site gets its own copy, and
Gemma 4 E2B's step has 241 of them: the int4 512-token step carries 260 MiB
of code on v6e-1 (bf16: 21 MiB) and does not fit a v5e-1 at default flags
(`CompileTimeHbmOom`, 205 MB over; E4B 834 MB; benchmarks/README.md).

Under gemma_qat the tiles change in two ways, decided per call from the
step's token count M:

- One M bucket (bucket_base = tile_m). The smaller buckets serve only a
  last tile the tokens do not fill; tpu-inference's token buckets are powers
  of two (up to --max-num-batched-tokens), multiples of tile_m, so those
  branches never run: the same work, a quarter of the code. A token count
  that is not a multiple computes its last tile whole, masked as before.
- From M >= 256 tokens (prefill-sized steps, where the code is largest),
  N tiles no wider than max(4 M, 2 MXU widths), dividing N. Each N tile
  reads the step's activations again, M x K x 2 bytes, against its
  weights' N_tile x K / 2: at N_tile >= 4 M those reads stay within the
  weight bytes. Decode-sized steps keep tokamax's N tiles (one grid step per
  linear where it fits VMEM: no per-step overhead added to decode).

What the TPU compiler says (libtpu, deviceless; benchmarks/README.md): one
E2B layer's six int4 linears at 512 tokens, v5e-1, 25.7 MiB of code with
tokamax's tiles, 8.8 with one bucket, 5.2 with both changes; full-size E2B
and E4B int4 now compile every step at default flags on v5e-1, and E2B's
512-token step on v6e-1 carries 17.0 MiB of code instead of 260.8. XLA's
cost estimate for the kernel is the kernel's own declaration, blind to
tiling: run-time cost on a TPU is not measured.

Decided per engine process: tpu-inference's JAX model build
(`get_flax_model`) says whether the model it builds serves gemma_qat
(tracing happens after).
"""
from __future__ import annotations

import dataclasses
import functools

from vllm_gemma_qat import substitute
from vllm_gemma_qat.gate import LOAD_FORMAT, is_gemma_qat
from vllm_gemma_qat.substitute import Substitution

LINEAR_MODULE = "tpu_inference.layers.common.linear"
MODEL_LOADER = "tpu_inference.models.common.model_loader"
PREFILL_TOKENS = 256

_serving_gemma_qat = False


def install() -> None:
    label = f"vllm-gemma-qat (--load-format {LOAD_FORMAT} only, int4 tiles)"
    substitute.apply_on_import(LINEAR_MODULE, linear_substitutions, label)
    substitute.apply_on_import(MODEL_LOADER, loader_substitutions, label)


def linear_substitutions() -> list[Substitution]:
    return [Substitution(
        f"{LINEAR_MODULE}:_safe_calculate_tiling", _compact,
        "gmm_v2 tiles with one M bucket, and N tiles bounded at "
        "prefill-sized steps: less generated code per int4 linear",
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


def compact_tiles(tiles, size_m: int, size_n: int, mxu_columns: int,
                  lanes: int):
    """tokamax's `tiles` for an M x N product, with one M bucket and, from
    PREFILL_TOKENS rows, N tiles of at most max(4 M, 2 MXU widths) columns
    (a multiple of `lanes` dividing N; tokamax's own when none does)."""
    tiles = dataclasses.replace(tiles, bucket_base=tiles.tile_m)
    if size_m < PREFILL_TOKENS:
        return tiles
    widest = max(4 * size_m, 2 * mxu_columns)
    for count in range(1, size_n // lanes + 1):
        width = size_n // count
        if size_n % count == 0 and width % lanes == 0 and width <= widest:
            if width < tiles.tile_n:
                tiles = dataclasses.replace(tiles, tile_n=width)
            break
    return tiles


def _compact(safe_calculate_tiling):

    @functools.wraps(safe_calculate_tiling)
    def tiling(dims, lhs_cfgs, rhs_cfgs, vmem_limit_bytes, fuse_act=None):
        tiles = safe_calculate_tiling(dims, lhs_cfgs, rhs_cfgs,
                                      vmem_limit_bytes, fuse_act)
        if (not _serving_gemma_qat or fuse_act is not None
                or dims.size_group != 1):  # dense linears only
            return tiles
        from jax.experimental.pallas import tpu as pltpu
        info = pltpu.get_tpu_info()
        return compact_tiles(tiles, dims.size_m, dims.size_n,
                             info.mxu_column_size, info.num_lanes)

    return tiling


def _noting_gemma_qat(get_flax_model):

    @functools.wraps(get_flax_model)
    def wrapped(vllm_config, *args, **kwargs):
        global _serving_gemma_qat
        _serving_gemma_qat = is_gemma_qat(vllm_config)
        return get_flax_model(vllm_config, *args, **kwargs)

    return wrapped
