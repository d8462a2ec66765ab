"""AOT mode: compile for a TPU topology on a machine without a TPU
("deviceless AOT", as MaxText's train_compile.py does), through libtpu.

`vllm-gemma-qat compile MODEL --topology v6e-4 --tp 4` runs the engine
core's start-up for the flags `vllm serve MODEL --load-format gemma_qat`
would get (config only: no weights are read) on the topology's chips, and
compiles each program tpu-inference's runner precompiles (`engine.py`;
the report: `compile.py`, `report.py`; a program compiled before the same
way is answered by what that compile gave, `analyses.py`). It needs these
changes to JAX / tpu-inference internals, declared in one table, applied
only for the duration of a compile (`substitute.applied`; `engine.py`
declares those of the runner's start-up the same way); a target missing
from what is installed stops it with `substitute.MissingTarget`:

- `preflight.check_local_checkpoint` (the plugin's own header check where
  vLLM builds its config): vLLM's config comes from a config-only directory;
  compile runs that check on the real checkpoint first.
- `model_loader._get_nnx_model`: the model as `nnx.eval_shape` of its class
  under the mesh (what the original does before loading), each parameter an
  abstract array with the sharding its partition spec names (what
  `create_sharded_model` constrains it to); int4 (wNa16) linears in the
  layout `process_weights_after_loading` leaves. No weights are allocated.
  The same for the drafter of speculative decoding (`--assistant`), which
  `Eagle3Proposer.load_model` builds through it.
- `eagle3.jnp` (jax.numpy as the proposer's module sees it), for
  `jnp.any` only: `Eagle3Proposer.load_model` asks whether the drafter's
  embedding holds any nonzero value; an abstract parameter has none to
  read: taken as yes (the checkpoint's own). For the Gemma 4 assistant the
  branch then taken shares the target's embedding unconditionally, as on a
  server; every other `jnp.*` is jax.numpy's.
- `kv_cache._get_kv_cache_allocator`: `create_kv_caches` returns abstract
  arrays (shape, dtype, sharding as it would allocate them).
- RPA v3's `get_tpu_version` (imported by name by `kernel.py` and
  `tuned_block_sizes.py`): reads `jax.devices()[0]`, the host's CPU here;
  the target TPU's version.

Everything else is tpu-inference's and the plugin's own code, unchanged
(the plugin's fixes are installed by `vllm_gemma_qat.register`).
"""
from __future__ import annotations

from dataclasses import dataclass

# vLLM / JAX / tpu-inference are imported lazily: cli.py imports this
# package only for `compile`.


@dataclass(frozen=True)
class Topology:
    name: str  # as Cloud TPU names the slice: v6e-4
    libtpu_name: str  # libtpu's topology name: v6e:2x2
    bounds: tuple  # chips per host (x, y, z)
    chips: int
    hbm_gib: float  # per chip
    tpu_version: int  # RPA v3's notion (v5e: 5, v6e: 6)

    @property
    def hosts(self) -> int:
        return self.chips // (self.bounds[0] * self.bounds[1] *
                              self.bounds[2])


# Multi-host slices (v6e-16 and up: 4 chips per host) are described by
# libtpu as one topology; `--tp N` shards over the first N chips, across
# hosts when N exceeds one host's, as tpu-inference's multi-host path
# (Ray) would lay one model over them. Nothing here can run them.
TOPOLOGIES = {t.name: t for t in (
    Topology("v5e-1", "v5e:1x1", (1, 1, 1), 1, 16.0, 5),
    Topology("v5e-4", "v5e:2x2", (2, 2, 1), 4, 16.0, 5),
    Topology("v5e-8", "v5e:2x4", (2, 4, 1), 8, 16.0, 5),
    Topology("v5e-16", "v5e:4x4", (2, 2, 1), 16, 16.0, 5),
    Topology("v6e-1", "v6e:1x1", (1, 1, 1), 1, 32.0, 6),
    Topology("v6e-4", "v6e:2x2", (2, 2, 1), 4, 32.0, 6),
    Topology("v6e-8", "v6e:2x4", (2, 4, 1), 8, 32.0, 6),
    Topology("v6e-16", "v6e:4x4", (2, 2, 1), 16, 32.0, 6),
    Topology("v6e-32", "v6e:4x8", (2, 2, 1), 32, 32.0, 6),
)}


class AotError(RuntimeError):
    """A request this mode cannot answer (named, with what it can)."""


def topology(name: str) -> Topology:
    try:
        return TOPOLOGIES[name]
    except KeyError:
        raise AotError(
            f"unknown topology {name!r}; known: "
            f"{', '.join(TOPOLOGIES)}") from None


def substitutions(topo: Topology, int4_layout) -> list:
    """The AOT mode's changes to JAX / tpu-inference internals, in order.
    `int4_layout(model, mesh)`: replaces wNa16 checkpoint parameters by the
    processed layout (compile.py)."""
    from vllm_gemma_qat.substitute import Substitution
    version = topo.tpu_version

    def tpu_version() -> int:
        return version

    rpa = "tpu_inference.kernels.ragged_paged_attention.v3"
    return [
        Substitution("vllm_gemma_qat.preflight:check_local_checkpoint",
                     _checked_already,
                     "vLLM's config is built from a config-only directory "
                     "(no shards to check); compile runs the same header "
                     "check on the real checkpoint first"),
        Substitution("vllm_gemma_qat.preflight:check_local_assistant",
                     _checked_already,
                     "the same for --speculative-config's assistant "
                     "(config-only too): compile checks the real one "
                     "against the target first"),
        Substitution("tpu_inference.models.common.model_loader:_get_nnx_model",
                     _abstract_model(int4_layout),
                     "no weights: the model as nnx.eval_shape builds it "
                     "under the mesh, parameters abstract with their "
                     "partition specs' shardings (int4 linears in the "
                     "processed wNa16 layout)"),
        Substitution("tpu_inference.runner.kv_cache:_get_kv_cache_allocator",
                     _abstract_allocator,
                     "create_kv_caches returns abstract arrays (its shapes, "
                     "dtype and sharding), allocating nothing"),
        Substitution(f"{rpa}.kernel:get_tpu_version", tpu_version,
                     f"RPA v3 reads jax.devices()[0] (the host CPU here): "
                     f"the target's TPU version ({version})"),
        Substitution(f"{rpa}.tuned_block_sizes:get_tpu_version", tpu_version,
                     "the same, imported by name for RPA's block sizes"),
        Substitution("tpu_inference.spec_decode.jax.eagle3:jnp",
                     _JnpAbstractAny(),
                     "Eagle3Proposer.load_model's jnp.any on the drafter's "
                     "embedding: an abstract parameter counts as nonzero "
                     "(no values to read); jax.numpy otherwise"),
    ]


def _checked_already(*args, **kwargs) -> None:
    return None


class _JnpAbstractAny:
    """jax.numpy, but `any` of an abstract array (a ShapeDtypeStruct) is
    True: there are no values to read."""

    def __getattr__(self, name):
        import jax.numpy as jnp
        return getattr(jnp, name)

    @staticmethod
    def any(x, *args, **kwargs):
        import jax
        import jax.numpy as jnp
        if isinstance(x, jax.ShapeDtypeStruct):
            return True
        return jnp.any(x, *args, **kwargs)


def _abstract_model(int4_layout):

    def get_nnx_model(model_class, vllm_config, rng, mesh, pooler=None,
                      is_draft_model=False):
        import jax
        from flax import nnx
        from jax.sharding import NamedSharding, PartitionSpec
        if pooler is not None:
            raise AotError("AOT mode builds generative models only (no "
                           "pooling)")
        with jax.set_mesh(mesh):
            model = nnx.eval_shape(lambda: model_class(vllm_config, rng, mesh),
                                   graph_updates=False)
        int4_layout(model, mesh)
        state = nnx.state(model)
        specs = nnx.get_partition_spec(state)

        def placed(x, spec):
            if isinstance(getattr(x, "sharding", None), NamedSharding):
                return x  # placed already (the int4 layout)
            if not isinstance(spec, PartitionSpec):
                spec = PartitionSpec()
            return jax.ShapeDtypeStruct(x.shape, x.dtype,
                                        sharding=NamedSharding(mesh, spec))

        nnx.update(model, jax.tree.map(
            placed, state, specs,
            is_leaf=lambda x: isinstance(x, PartitionSpec)))
        return model

    return get_nnx_model


def _abstract_allocator(cache_shape, cache_dtype, sharding):
    import jax

    def allocate():
        return jax.ShapeDtypeStruct(cache_shape, cache_dtype,
                                    sharding=sharding)

    return allocate
