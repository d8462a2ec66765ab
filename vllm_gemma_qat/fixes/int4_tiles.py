"""The int4 tile rule of patch 0013 (`int4_tiling.py` installs it), alone:
it imports nothing of the plugin, so `benchmarks/tpu_kernels.py` can carry
it to a TPU VM that has only jax and libtpu."""
from __future__ import annotations

import dataclasses

PREFILL_TOKENS = 256  # from here a step is prefill-sized
# The most MXU-sized (MXU width x MXU width) blocks of weights one tile
# holds: gmm_v2's body is unrolled over them (v5e: 2^21 int4 values, 1 MiB).
MXU_BLOCKS_PER_TILE = 128


def widest_divisor(size: int, lanes: int, widest: int) -> int | None:
    """The widest multiple of `lanes` that divides `size` and is at most
    `widest`; None if there is none."""
    for count in range(1, size // lanes + 1):
        width = size // count
        if size % count == 0 and width % lanes == 0 and width <= widest:
            return width
    return None


def compact_tiles(tiles, size_m: int, size_n: int, mxu_columns: int,
                  lanes: int):
    """tokamax's `tiles` for an M x N product, with one M bucket and N
    tiles (a multiple of `lanes` dividing N; tokamax's own when none does)
    that keep tile_k x tile_n within MXU_BLOCKS_PER_TILE MXU blocks and,
    from PREFILL_TOKENS rows, within max(4 M, 2 MXU widths) columns."""
    tiles = dataclasses.replace(tiles, bucket_base=tiles.tile_m)
    widest = MXU_BLOCKS_PER_TILE * mxu_columns**2 // tiles.tile_k
    if size_m >= PREFILL_TOKENS:
        widest = min(widest, max(4 * size_m, 2 * mxu_columns))
    width = widest_divisor(size_n, lanes, max(widest, lanes))
    if width and width < tiles.tile_n:
        tiles = dataclasses.replace(tiles, tile_n=width)
    return tiles


def for_the_chip(tiles, dims):
    """`compact_tiles` for gmm_v2's `dims`, on the TPU being compiled for
    (its MXU width and lane count)."""
    from jax.experimental.pallas import tpu as pltpu
    info = pltpu.get_tpu_info()
    return compact_tiles(tiles, dims.size_m, dims.size_n,
                         info.mxu_column_size, info.num_lanes)
