"""Runtime fix for tpu-inference #3225, active only under --load-format
gemma_qat. Upstream patch: patches/0001-* (write-up: patches/README.md).

tpu-inference 0.32's JAX `Gemma4Attention` builds k_proj / v_proj / k_norm on
every layer, although KV-shared layers read K/V from their source layer's
cache slot and never use them. QAT exports omit those tensors, so they cannot
load. While a `Gemma4Model` is built for gemma_qat, shared layers here get a
parameter-free stand-in instead: it hands the attention kernel the (T, K, H)
K/V operand its signature requires (ignored, as the layer passes
`update_kv_cache=False`), so no K/V projection is computed.

Other load formats and models are untouched. When tpu-inference already
builds no K/V for shared layers (the upstream fix), nothing is changed.

Also under gemma_qat only: tpu-inference 0.32's compressed-tensors config
gives an ignored fused gate_up_proj the plain `UnquantizedLinearMethod`,
which cannot load the separate gate_proj / up_proj tensors (`Shape mismatch
... gate_up_proj.weight`); such a layer gets the merged method that
tpu-inference's own unquantized config picks. That is what keeps an
off-grid MLP bf16 inside an otherwise int4 q4_0 model.
"""
from __future__ import annotations

import contextvars
import functools
import importlib.util
import sys

from vllm.logger import init_logger

from vllm_gemma_qat import substitute
from vllm_gemma_qat.gate import LOAD_FORMAT, is_gemma_qat
from vllm_gemma_qat.substitute import Substitution

TARGET_MODULE = "tpu_inference.models.jax.gemma4"
CT_MODULE = "tpu_inference.layers.jax.quantization.compressed_tensors"

# Under the "vllm" logger so the lines show in vLLM's own log output.
logger = init_logger(f"vllm.{__name__}")
_building_for_gemma_qat = contextvars.ContextVar("building_for_gemma_qat",
                                                 default=False)


def building_for_gemma_qat() -> bool:
    """Whether a Gemma 4 JAX model is being built for gemma_qat now."""
    return _building_for_gemma_qat.get()


def install() -> None:
    """Patch the Gemma 4 JAX module now if it is imported, else right after
    its import (importing it eagerly would cost every vLLM process ~8 s)."""
    substitute.after_import(TARGET_MODULE, apply)


# tpu-inference releases whose Gemma 4 has the structure this patch expects
# (separate k_proj / v_proj / k_norm, KV sharing); see README's version table.
SUPPORTED = "0.22.1, 0.23.0 and 0.28.0-0.32.0"


class UnsupportedTpuInference(RuntimeError):
    """The installed tpu-inference's Gemma 4 is not what gemma_qat patches."""


def unsupported_structure(gemma4) -> str | None:
    """Why the installed Gemma 4 cannot be patched, or None. Decided from the
    code itself: the version number misleads (source installs say 0.0.0)."""
    import inspect
    return unsupported_structure_in_source(inspect.getsource(gemma4))


def unsupported_structure_in_source(source: str) -> str | None:
    """`unsupported_structure` for the text of a tpu-inference gemma4.py."""
    import ast
    tree = ast.parse(source)
    classes = {node.name: ast.get_source_segment(source, node)
               for node in tree.body if isinstance(node, ast.ClassDef)}
    for name in ("Gemma4Model", "Gemma4Attention"):
        if name not in classes:
            return f"gemma4.py has no {name}"
    attention = classes["Gemma4Attention"]
    if "qkv_proj" in attention:
        return "Gemma4Attention fuses Q/K/V into one qkv_proj"
    if ("compute_kv_share_map" not in source
            or "self.is_kv_shared_layer" not in attention):
        return "its Gemma 4 has no KV sharing (no compute_kv_share_map)"
    for attr in ("k_proj", "v_proj", "k_norm", "num_kv_heads", "head_dim"):
        if f"self.{attr} =" not in attention:
            return f"Gemma4Attention no longer sets self.{attr}"
    return None


def tpu_inference_version() -> str:
    import importlib.metadata
    try:
        return importlib.metadata.version("tpu-inference")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def apply(gemma4) -> None:
    reason = unsupported_structure(gemma4)
    substitute.apply(substitutions(reason), "vllm-gemma-qat (--load-format "
                     f"{LOAD_FORMAT} only)")


def substitutions(unsupported: str | None) -> list[Substitution]:
    """What the patch changes in the installed tpu-inference. On a Gemma 4
    it cannot patch, only the guard that refuses gemma_qat."""
    table = [Substitution(
        f"{TARGET_MODULE}:Gemma4Model.__init__",
        functools.partial(_guarded_model_init, unsupported=unsupported),
        "refuse gemma_qat on an unsupported tpu-inference; mark the build as "
        "gemma_qat's for the substitutions below", wraps=True)]
    if unsupported:
        return table
    table.append(Substitution(
        f"{TARGET_MODULE}:Gemma4Attention.__init__", _kv_free_shared_layers,
        "#3225: KV-shared layers get no k_proj / v_proj / k_norm", wraps=True))
    if importlib.util.find_spec(CT_MODULE) is not None:  # JAX CT path exists
        table.append(Substitution(
            f"{CT_MODULE}:CompressedTensorsConfig.get_quant_method",
            _merged_method_for_ignored_gate_up,
            "an ignored fused gate_up_proj gets the merged unquantized method "
            "(the plain one cannot load gate_proj / up_proj)", wraps=True))
    return table


def _merged_method_for_ignored_gate_up(get_quant_method):
    from tpu_inference.layers.jax.linear import JaxMergedColumnParallelLinear
    from tpu_inference.layers.jax.quantization.unquantized import (
        UnquantizedConfig, UnquantizedLinearMethod)

    @functools.wraps(get_quant_method)
    def wrapped(self, layer, prefix):
        method = get_quant_method(self, layer, prefix)
        if (_building_for_gemma_qat.get()
                and type(method) is UnquantizedLinearMethod
                and isinstance(layer, JaxMergedColumnParallelLinear)):
            return UnquantizedConfig({}).get_quant_method(layer, prefix)
        return method

    return wrapped


def _guarded_model_init(init, unsupported: str | None):

    @functools.wraps(init)
    def __init__(self, vllm_config, *args, **kwargs):
        gemma_qat = is_gemma_qat(vllm_config)
        if gemma_qat and unsupported:
            raise UnsupportedTpuInference(
                f"--load-format {LOAD_FORMAT} does not support the installed "
                f"tpu-inference {tpu_inference_version()}: {unsupported}. "
                f"Supported: tpu-inference {SUPPORTED}")
        token = _building_for_gemma_qat.set(gemma_qat)
        try:
            init(self, vllm_config, *args, **kwargs)
        finally:
            _building_for_gemma_qat.reset(token)

    return __init__


def _kv_free_shared_layers(init):

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if not (_building_for_gemma_qat.get() and self.is_kv_shared_layer):
            return
        if getattr(self, "k_proj", None) is None:
            logger.info("tpu-inference already builds no K/V for KV-shared "
                        "layers; vllm-gemma-qat leaves Gemma4Attention as is")
            return
        gemma4 = sys.modules[TARGET_MODULE]
        self.k_proj = _no_kv_projection_class(gemma4.JaxModule)(
            self.num_kv_heads, self.head_dim)
        self.v_proj = None  # __call__ then reuses the k operand as v
        self.k_norm = None

    return __init__


@functools.cache
def _no_kv_projection_class(module_base):

    class NoKVProjection(module_base):
        """Parameter-free stand-in for a KV-shared layer's k_proj: returns
        the zero (T, K, H) operand the attention call needs but never reads."""

        def __init__(self, num_kv_heads: int, head_dim: int):
            self.num_kv_heads = num_kv_heads
            self.head_dim = head_dim

        def __call__(self, x):
            import jax.numpy as jnp
            return jnp.zeros((x.shape[0], self.num_kv_heads, self.head_dim),
                             x.dtype)

    return NoKVProjection
