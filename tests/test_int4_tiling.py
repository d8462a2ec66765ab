"""int4 linears' gmm_v2 tiles under gemma_qat (fixes/int4_tiling.py, patch
0013): one M bucket, N tiles bounded (a weight tile of at most 128 MXU
blocks; prefill-sized steps: also max(4 M, 2 MXU widths) columns). The
kernel in Pallas TPU interpret mode still computes the exact product with
them, and the TPU compiler (libtpu, deviceless, v5e-1) emits less code for
them."""
import numpy as np
import pytest

from vllm_gemma_qat import substitute
from vllm_gemma_qat.fixes import int4_tiles, int4_tiling

from test_real_kernels import (gmm_tolerance, plugin_int4, q4_0_linear,
                               quantized_matmul)


@pytest.fixture
def tiles_seen(monkeypatch):
    """The tiles each gmm_v2 call gets, with the fix's substitution in
    place (its switch, `_serving_gemma_qat`, set by each test as the model
    build sets it)."""
    from tpu_inference.layers.common import linear
    seen = []
    with substitute.applied(int4_tiling.linear_substitutions(), "test"):
        compact = linear._safe_calculate_tiling

        def recording(dims, *args, **kwargs):
            tiles = compact(dims, *args, **kwargs)
            seen.append((dims.size_m, dims.size_n, tiles))
            return tiles
        monkeypatch.setattr(linear, "_safe_calculate_tiling", recording)
        yield seen


def test_compact_tiles_keep_one_bucket_and_bound_n():
    from tokamax._src.ops.experimental.gmm_v2.gmm_v2 import TileSizes
    stock = TileSizes(tile_m=256, tile_k=1536, tile_n=12288, bucket_base=64)
    # 512 tokens, v6e (MXU 256): at most 4 x 512 columns, dividing 12288;
    # v5e (MXU 128): 128 blocks of 128 x 128 over K = 1536 bound it first.
    prefill = int4_tiles.compact_tiles(stock, 512, 12288, 256, 128)
    assert (prefill.tile_m, prefill.bucket_base, prefill.tile_n) == (
        256, 256, 2048)
    assert int4_tiles.compact_tiles(stock, 512, 12288, 128, 128).tile_n == 1024
    # A weight tile of at most 128 MXU blocks (v5e: 128 x 128 values each,
    # 2^21 in all; v6e: 256 x 256) at any step size: E2B's wide gate_up at
    # decode, K = 1536, gets N tiles of 1024 on v5e, 4096 on v6e, not one
    # of 24,576; E4B's down projection (K = 10,240) 128 on v5e.
    decode = int4_tiles.compact_tiles(
        TileSizes(tile_m=8, tile_k=1536, tile_n=24576, bucket_base=8),
        8, 24576, 128, 128)
    assert decode.tile_n == 1024
    assert int4_tiles.compact_tiles(
        TileSizes(tile_m=8, tile_k=1536, tile_n=24576, bucket_base=8),
        8, 24576, 256, 128).tile_n == 4096
    assert int4_tiles.compact_tiles(
        TileSizes(tile_m=64, tile_k=10240, tile_n=2560, bucket_base=64),
        64, 2560, 128, 128).tile_n == 128
    # A tile already within both bounds is tokamax's.
    assert int4_tiles.compact_tiles(
        TileSizes(tile_m=8, tile_k=1536, tile_n=1024, bucket_base=8),
        8, 2048, 128, 128).tile_n == 1024


def test_gemma_qat_tiles_compute_the_exact_product_in_interpret_mode(
        tiles_seen, monkeypatch):
    """320 tokens: two M tiles of 256 (the second 64 rows full, one bucket
    for both), the output in two N tiles of 1024 (tokamax: one of 2048)."""
    import jax
    import jax.numpy as jnp
    m, n_in, n_out = 320, 64, 2048
    weight = q4_0_linear(n_out, n_in, seed=3)
    w, s = plugin_int4(weight)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((m, n_in)),
                    "float32")
    xf = np.asarray(x, np.float64)
    exact = xf @ weight.astype(np.float64).T
    tol = gmm_tolerance("float32", xf, weight.astype(np.float64))

    # The tiles are chosen when gmm_v2 is traced (a server sets the switch
    # before it traces anything; in this process an earlier test's model
    # load may have set it): set it, and trace again each time.
    monkeypatch.setattr(int4_tiling, "_serving_gemma_qat", False)
    jax.clear_caches()
    stock = quantized_matmul(x, w, s, "interpret")
    (*_, stock_tiles) = tiles_seen[-1]
    jax.clear_caches()
    monkeypatch.setattr(int4_tiling, "_serving_gemma_qat", True)
    compact = quantized_matmul(x, w, s, "interpret")
    (*_, tiles) = tiles_seen[-1]
    assert (tiles.tile_m, tiles.bucket_base, tiles.tile_n) == (256, 256, 1024)
    assert stock_tiles.bucket_base < stock_tiles.tile_m
    assert stock_tiles.tile_n == n_out
    assert (np.abs(compact - exact) <= tol).all(), np.abs(compact - exact).max()
    assert (np.abs(stock - exact) <= tol).all()
    # The comparison can fail: a scale group of one output column negated.
    wrong = weight.astype(np.float64).copy()
    wrong[1000, :32] *= -1
    assert (np.abs(compact - xf @ wrong.T) > 10 * tol).any()


def _code_bytes(m, k, n, serving, monkeypatch):
    """Generated code of one int4 linear (tpu-inference's wNa16 call),
    compiled by libtpu for a v5e-1 without one."""
    import os
    import jax
    import jax.numpy as jnp
    import numpy
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from tpu_inference.layers.common.linear import sharded_quantized_matmul

    from vllm_gemma_qat.aot import topology
    monkeypatch.setenv("TPU_SKIP_MDS_QUERY", "1")
    monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    monkeypatch.setattr(int4_tiling, "_serving_gemma_qat", serving)
    jax.clear_caches()  # gmm_v2 picks its tiles when traced
    v5e = topology("v5e-1")
    desc = topologies.get_topology_desc(
        platform="tpu", topology_name=v5e.libtpu_name,
        chip_config_name="default", chips_per_host_bounds=v5e.bounds,
        num_slices=1)
    mesh = Mesh(numpy.array(desc.devices[:1]).reshape(1, 1),
                ("data", "model"))
    spec = P(None, "model")

    def sds(shape, dtype, spec):
        return jax.ShapeDtypeStruct(shape, dtype,
                                    sharding=NamedSharding(mesh, spec))
    args = (sds((m, k), jnp.bfloat16, P("data", None)),
            sds((k, n), jnp.int4, spec),
            sds((k // 32, 1, n), jnp.bfloat16, P(None, None, "model")))
    assert os.environ["JAX_PLATFORMS"] == "cpu"
    with jax.set_mesh(mesh):
        compiled = jax.jit(lambda x, w, s: sharded_quantized_matmul(
            x, w, s, spec, mesh=mesh, maybe_quantize_x=False)
        ).lower(*args).compile()
    return compiled.memory_analysis().generated_code_size_in_bytes


def test_the_tpu_compiler_emits_less_code_for_a_prefill_step(
        tiles_seen, monkeypatch):
    m, k, n = 512, 256, 4096
    stock = _code_bytes(m, k, n, False, monkeypatch)
    compact = _code_bytes(m, k, n, True, monkeypatch)
    print(f"int4 linear {m}x{k}x{n} on v5e-1: {stock / 2**20:.2f} MiB of "
          f"code with tokamax's tiles, {compact / 2**20:.2f} with one bucket "
          "and N tiles of 2048")
    (*_, tiles) = tiles_seen[-1]
    assert (tiles.bucket_base, tiles.tile_n) == (tiles.tile_m, 2048)
    assert compact * 3 <= stock, (stock, compact)


def test_the_tpu_compiler_emits_less_code_for_a_decode_step(
        tiles_seen, monkeypatch):
    """tokamax takes the whole N at decode (one grid step, its body
    unrolled over 4 x 128 MXU blocks of a v5e here); gemma_qat 4 tiles of
    128 blocks."""
    m, k, n = 16, 512, 16384
    stock = _code_bytes(m, k, n, False, monkeypatch)
    (*_, stock_tiles) = tiles_seen[-1]
    compact = _code_bytes(m, k, n, True, monkeypatch)
    (*_, tiles) = tiles_seen[-1]
    print(f"int4 linear {m}x{k}x{n} on v5e-1: {stock / 2**20:.2f} MiB of "
          f"code with tokamax's tiles, {compact / 2**20:.2f} with N tiles "
          "of 4096")
    assert (stock_tiles.tile_n, tiles.tile_n) == (n, 4096)
    assert compact * 2 <= stock, (stock, compact)
