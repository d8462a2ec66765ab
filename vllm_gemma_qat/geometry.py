"""What a Gemma 4 checkpoint must contain, derived from config.json alone.

One source of truth for the loader and for `vllm-gemma-qat inspect`: the
language-model tensors `--load-format gemma_qat` loads (KV-shared layers own
no k_proj / v_proj / k_norm), the ones it skips on purpose, and the KV-cache
geometry used by `plan`.
"""
from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from vllm_gemma_qat import quantization
from vllm_gemma_qat.checkpoint import Checkpoint, CheckpointError, TensorInfo
from vllm_gemma_qat.quantization import GROUP_SIZE, PACKED_SUFFIXES

GEMMA4_ARCHITECTURES = ("Gemma4ForConditionalGeneration", "Gemma4ForCausalLM")
SHARED_KV_PARAMS = ("self_attn.k_proj", "self_attn.v_proj", "self_attn.k_norm")
# 2-D weights that are not Linear layers (compressed-tensors never packs them).
EMBEDDINGS = ("embed_tokens.weight", "embed_tokens_per_layer.weight")
_LAYER_RE = re.compile(r"^(model\.(?:language_model\.)?)layers\.(\d+)\.(.+)$")


@cache
def _compute_kv_share_map():
    # tpu-inference's own helper, loaded from its file: importing the
    # `tpu_inference` package pulls in vLLM and JAX (~9 s), which would make
    # the header-only preflight slow. kv_share.py has no imports of its own.
    spec = importlib.util.find_spec("tpu_inference")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("tpu-inference is not installed (pip install vllm-tpu)")
    file = Path(spec.submodule_search_locations[0], "models", "common",
                "kv_share.py")
    mod_spec = importlib.util.spec_from_file_location("_tpu_inference_kv_share",
                                                      file)
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    return module.compute_kv_share_map


class _Attrs:
    """Attribute view of a config dict, as compute_kv_share_map expects."""

    def __init__(self, d: dict):
        self.__dict__.update(d)


def text_config_of(config: dict) -> dict:
    return config.get("text_config") or config


def architecture_of(config: dict) -> str:
    archs = config.get("architectures") or []
    for arch in archs:
        if arch in GEMMA4_ARCHITECTURES:
            return arch
    model_type = text_config_of(config).get("model_type")
    raise CheckpointError(
        f"config.json: architectures {archs} (model_type {model_type!r}) is not "
        f"Gemma 4; --load-format gemma_qat serves {', '.join(GEMMA4_ARCHITECTURES)}")


@dataclass(frozen=True)
class Geometry:
    text: dict
    layer_types: tuple[str, ...]
    kv_share_map: dict[int, int]

    @classmethod
    def from_text_config(cls, text: dict) -> "Geometry":
        required = ("num_hidden_layers", "hidden_size", "num_attention_heads",
                    "head_dim", "intermediate_size", "vocab_size")
        for key in required:
            if key not in text:
                raise CheckpointError(f"config.json: text config lacks {key!r}")
        n = text["num_hidden_layers"]
        layer_types = tuple(text.get("layer_types") or ())
        if len(layer_types) != n:
            raise CheckpointError(
                f"config.json: layer_types has {len(layer_types)} entries, "
                f"num_hidden_layers is {n}")
        try:
            share = _compute_kv_share_map()(_Attrs(text))
        except ValueError as e:
            raise CheckpointError(f"config.json: {e}") from None
        return cls(text, layer_types, share)

    @property
    def num_layers(self) -> int:
        return self.text["num_hidden_layers"]

    @property
    def num_kv_shared_layers(self) -> int:
        return len(self.kv_share_map)

    def _layer_override(self, i: int, key: str):
        # transformers >= 5.15 keeps full-attention overrides per layer.
        per_layer = self.text.get("per_layer_config") or {}
        for k in (str(i), f"{i:02d}"):
            if k in per_layer and key in per_layer[k]:
                return per_layer[k][key]
        return None

    def is_full(self, i: int) -> bool:
        return self.layer_types[i] == "full_attention"

    def head_dim(self, i: int) -> int:
        override = self._layer_override(i, "head_dim")
        if override is not None:
            return override
        if self.is_full(i) and self.text.get("global_head_dim"):
            return self.text["global_head_dim"]
        return self.text["head_dim"]

    def kv_heads(self, i: int) -> int:
        override = self._layer_override(i, "num_key_value_heads")
        if override is not None:
            return override
        if self.is_full(i) and self.text.get("num_global_key_value_heads"):
            return self.text["num_global_key_value_heads"]
        return self.text["num_key_value_heads"]

    def has_v_proj(self, i: int) -> bool:
        return not (self.is_full(i) and self.text.get("attention_k_eq_v"))

    def intermediate_size(self, i: int) -> int:
        wide = self.text.get("use_double_wide_mlp") and i in self.kv_share_map
        return self.text["intermediate_size"] * (2 if wide else 1)

    def layer_tensors(self, i: int) -> dict[str, tuple[int, ...]]:
        """Tensors of layer i that gemma_qat loads, HF [out, in] shapes."""
        h = self.text["hidden_size"]
        hd, kv, heads = self.head_dim(i), self.kv_heads(i), self.text[
            "num_attention_heads"]
        inter = self.intermediate_size(i)
        t = {f"{norm}.weight": (h, ) for norm in (
            "input_layernorm", "post_attention_layernorm",
            "pre_feedforward_layernorm", "post_feedforward_layernorm")}
        t["layer_scalar"] = (1, )
        t["self_attn.q_proj.weight"] = (heads * hd, h)
        t["self_attn.o_proj.weight"] = (h, heads * hd)
        t["self_attn.q_norm.weight"] = (hd, )
        if i not in self.kv_share_map:
            t["self_attn.k_proj.weight"] = (kv * hd, h)
            if self.has_v_proj(i):
                t["self_attn.v_proj.weight"] = (kv * hd, h)
            t["self_attn.k_norm.weight"] = (hd, )
        t["mlp.gate_proj.weight"] = (inter, h)
        t["mlp.up_proj.weight"] = (inter, h)
        t["mlp.down_proj.weight"] = (h, inter)
        p = self.text.get("hidden_size_per_layer_input") or 0
        if p:
            t["post_per_layer_input_norm.weight"] = (h, )
            t["per_layer_input_gate.weight"] = (p, h)
            t["per_layer_projection.weight"] = (h, p)
        return t

    def shared_kv_tensors(self, i: int) -> dict[str, tuple[int, ...]]:
        """The unused K/V tensors a regular export ships for shared layer i."""
        h, hd, kv = self.text["hidden_size"], self.head_dim(i), self.kv_heads(i)
        t = {"self_attn.k_proj.weight": (kv * hd, h),
             "self_attn.k_norm.weight": (hd, )}
        if self.has_v_proj(i):
            t["self_attn.v_proj.weight"] = (kv * hd, h)
        return t

    def global_tensors(self) -> dict[str, tuple[int, ...]]:
        h, v = self.text["hidden_size"], self.text["vocab_size"]
        t = {"embed_tokens.weight": (v, h), "norm.weight": (h, )}
        p = self.text.get("hidden_size_per_layer_input") or 0
        if p:
            n, vp = self.num_layers, self.text.get("vocab_size_per_layer_input",
                                                   v)
            t["embed_tokens_per_layer.weight"] = (vp, n * p)
            t["per_layer_model_projection.weight"] = (n * p, h)
            t["per_layer_projection_norm.weight"] = (p, )
        return t

    def expected(self, prefix: str) -> dict[str, tuple[int, ...]]:
        """Every language-model tensor gemma_qat needs, full names."""
        out = {prefix + k: s for k, s in self.global_tensors().items()}
        for i in range(self.num_layers):
            for k, s in self.layer_tensors(i).items():
                out[f"{prefix}layers.{i}.{k}"] = s
        return out

    def linear_modules(self, prefix: str) -> list[str]:
        """The language model's Linear layers (module names): the ones a
        compressed-tensors config with target "Linear" may pack as int4."""
        return [n.removesuffix(".weight")
                for n, shape in self.expected(prefix).items()
                if len(shape) == 2 and not n.endswith(EMBEDDINGS)]

    def skippable(self, prefix: str) -> dict[str, tuple[int, ...]]:
        return {f"{prefix}layers.{i}.{k}": s
                for i in self.kv_share_map
                for k, s in self.shared_kv_tensors(i).items()}

    def kv_elements_per_token(self) -> int:
        """K + V elements one token occupies: only non-shared layers hold KV."""
        return sum(2 * self.kv_heads(i) * self.head_dim(i)
                   for i in range(self.num_layers) if i not in self.kv_share_map)


def is_shared_kv_tensor(name: str, kv_share_map: dict[int, int]) -> bool:
    """True for a shared layer's k_proj / v_proj / k_norm tensor (any suffix),
    anchored on the language model's layers so tower k_proj never match."""
    m = _LAYER_RE.match(name)
    return bool(m and int(m.group(2)) in kv_share_map
                and m.group(3).startswith(SHARED_KV_PARAMS))


def language_model_prefix(names) -> str:
    """`model.language_model.` (what the real exports use) or `model.`
    (what transformers writes for a text-only Gemma4ForCausalLM)."""
    if any(n.startswith("model.language_model.") for n in names):
        return "model.language_model."
    return "model."


def is_language_model_tensor(name: str, prefix: str) -> bool:
    if not name.startswith(prefix):
        return name.startswith("lm_head.")
    rest = name[len(prefix):]
    return not rest.startswith(("vision_tower.", "audio_tower.",
                                "embed_vision.", "embed_audio."))


@dataclass
class CheckpointReport:
    """How a checkpoint's language-model tensors compare with what gemma_qat
    loads. Towers are left to tpu-inference's own loader."""
    architecture: str
    geometry: Geometry
    prefix: str
    export_kind: str
    expected: dict[str, tuple[int, ...]]
    missing: list[str]
    unexpected: list[str]
    wrong_shape: list[tuple[str, tuple[int, ...], tuple[int, ...]]]
    skipped: list[str]
    lm_tensors: int
    shared_kv_inferred: int | None
    # Linear modules the checkpoint holds pack-quantized (int4).
    quantized: list[str]
    # Disagreements between those and config.json's quantization_config.
    inconsistent: list[str]
    # What config.json lacks for its architecture to build.
    config_errors: list[str] = field(default_factory=list)

    @property
    def loads_with_gemma_qat(self) -> bool:
        return not (self.missing or self.unexpected or self.wrong_shape
                    or self.shared_kv_mismatch or self.inconsistent
                    or self.config_errors)

    @property
    def shared_kv_mismatch(self) -> bool:
        return (self.shared_kv_inferred is not None and
                self.shared_kv_inferred != self.geometry.num_kv_shared_layers)

    @property
    def loads_with_auto(self) -> bool:
        # Stock tpu-inference allocates K/V on every layer, so it also needs
        # the shared-layer tensors only a regular export ships.
        return self.loads_with_gemma_qat and len(self.skipped) == len(
            self.geometry.skippable(self.prefix))

    def errors(self) -> list[str]:
        out = list(self.config_errors)
        g = self.geometry
        if self.shared_kv_mismatch:
            out.append(
                f"config.json says num_kv_shared_layers="
                f"{g.num_kv_shared_layers}, but the checkpoint has K/V "
                f"projections for {g.num_layers - self.shared_kv_inferred} of "
                f"{g.num_layers} layers (i.e. {self.shared_kv_inferred} shared)")
        out += [f"missing tensor {n}" + (
            f" (expected shape {list(self.expected[n])})"
            if n in self.expected else "") for n in self.missing]
        out += [f"tensor {n} has shape {list(got)}, expected {list(want)}"
                for n, got, want in self.wrong_shape]
        out += [f"unexpected tensor {n}" for n in self.unexpected]
        out += self.inconsistent
        return out

    def raise_if_invalid(self, path) -> None:
        errs = self.errors()
        if errs:
            more = f" (and {len(errs) - 5} more)" if len(errs) > 5 else ""
            raise CheckpointError(f"{path}: " + "; ".join(errs[:5]) + more)


def _infer_shared_kv(tensors: dict[str, TensorInfo], prefix: str,
                     num_layers: int) -> int | None:
    """Count of trailing layers with no k_proj, or None if K/V is present on
    every layer (regular export) or the pattern is not a clean tail."""
    has_k = [any(n.startswith(f"{prefix}layers.{i}.self_attn.k_proj.")
                 for n in tensors) for i in range(num_layers)]
    if all(has_k):
        return None
    first_missing = has_k.index(False)
    if any(has_k[first_missing:]):
        return None
    return num_layers - first_missing


def check(ckpt: Checkpoint) -> CheckpointReport:
    """Compare a checkpoint's headers with what gemma_qat loads."""
    arch = architecture_of(ckpt.config)
    geo = Geometry.from_text_config(text_config_of(ckpt.config))
    prefix = language_model_prefix(ckpt.tensors)
    expected = geo.expected(prefix)
    linears = set(geo.linear_modules(prefix))
    found = _sort_tensors(ckpt.tensors, prefix, geo, expected, linears)
    missing = found.missing(expected)  # before `unexpected`: it adds to it
    quantized = sorted(found.packed)
    kind = ("qat-w4a16-ct" if quantized else
            "regular-bf16" if found.skipped else "qat-bf16")
    return CheckpointReport(
        arch, geo, prefix, kind, expected, sorted(missing),
        sorted(found.unexpected), found.wrong_shape, sorted(found.skipped),
        found.lm_tensors, _infer_shared_kv(ckpt.tensors, prefix, geo.num_layers),
        quantized,
        _quantization_mismatches(ckpt.config, linears, set(found.packed)),
        config_errors(ckpt.config))


def config_errors(config: dict) -> list[str]:
    """tpu-inference builds Gemma4ForConditionalGeneration's vision tower
    from `vision_config` (a null one fails in the engine: `'NoneType' object
    has no attribute 'patch_size'`)."""
    if architecture_of(config) == "Gemma4ForConditionalGeneration" and \
            not config.get("vision_config"):
        return ["config.json: vision_config is null, and architectures "
                "Gemma4ForConditionalGeneration builds a vision tower from "
                "it; a checkpoint without towers declares architectures "
                '["Gemma4ForCausalLM"]']
    return []


@dataclass
class _SortedTensors:
    """A checkpoint's language-model tensors, sorted against `expected`."""
    seen: set[str] = field(default_factory=set)
    skipped: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    wrong_shape: list = field(default_factory=list)
    packed: dict[str, set[str]] = field(default_factory=dict)  # module -> suffixes
    lm_tensors: int = 0

    def missing(self, expected) -> list[str]:
        """Expected tensors absent (a packed module's `weight` is not), and
        the incomplete packed triples; flags a module stored both ways."""
        out = [n for n in expected if n not in self.seen
               and n.removesuffix(".weight") not in self.packed]
        for module, suffixes in self.packed.items():
            out += [f"{module}.{s}" for s in PACKED_SUFFIXES
                    if s not in suffixes]
            if module + ".weight" in self.seen:
                self.unexpected.append(f"{module}.weight (the module is also "
                                       "pack-quantized)")
        return out


def _sort_tensors(tensors: dict[str, TensorInfo], prefix: str, geo: Geometry,
                  expected: dict, linears: set[str]) -> _SortedTensors:
    out = _SortedTensors()
    for name, info in tensors.items():
        if not is_language_model_tensor(name, prefix):
            continue
        out.lm_tensors += 1
        if name == "lm_head.weight" or name == f"{prefix}lm_head.weight":
            # Tied to embed_tokens in every Gemma 4 export; tolerated either way.
            continue
        if is_shared_kv_tensor(name, geo.kv_share_map):
            out.skipped.append(name)
            continue
        module, _, suffix = name.rpartition(".")
        if suffix in PACKED_SUFFIXES and module in linears:
            out.packed.setdefault(module, set()).add(suffix)
            want = _packed_shape(suffix, expected[module + ".weight"])
        elif name in expected:
            out.seen.add(name)
            want = expected[name]
        else:
            out.unexpected.append(name)
            continue
        if info.shape != want:
            out.wrong_shape.append((name, info.shape, want))
    return out


def _packed_shape(suffix: str, weight_shape: tuple[int, int]) -> tuple:
    out_features, in_features = weight_shape
    return {"weight_packed": (out_features, in_features // 8),
            "weight_scale": (out_features, in_features // GROUP_SIZE),
            "weight_shape": (2, )}[suffix]


def _quantization_mismatches(config: dict, linears: set[str],
                             packed: set[str]) -> list[str]:
    """Where the tensors and config.json's quantization_config disagree on
    which linears are int4, or where tpu-inference could not serve the mix."""
    out = []
    qc = config.get("quantization_config")
    if packed and not quantization.is_compressed_tensors(qc):
        out.append(f"{len(packed)} linears are pack-quantized (first: "
                   f"{min(packed)}), but config.json has no compressed-tensors "
                   "quantization_config")
    elif quantization.is_compressed_tensors(qc):
        for module in sorted(linears):
            wanted = quantization.quantizes(qc, module)
            if wanted and module not in packed:
                out.append(f"quantization_config quantizes {module}, but the "
                           f"checkpoint holds it as bf16 {module}.weight")
            elif module in packed and not wanted:
                out.append(f"{module} is pack-quantized in the checkpoint, but "
                           "quantization_config does not quantize it (targets "
                           f"{quantization.targets(qc)}, ignore "
                           f"{qc.get('ignore') or []})")
    out += gate_up_mismatches(linears, packed)
    return out


def fused_partner(module: str) -> str | None:
    """The other half of the linear tpu-inference fuses `module` into
    (mlp.gate_proj <-> mlp.up_proj), else None."""
    for half, other in ((".mlp.gate_proj", ".mlp.up_proj"),
                        (".mlp.up_proj", ".mlp.gate_proj")):
        if module.endswith(half):
            return module.removesuffix(half) + other
    return None


# Linears whose input dim tensor parallelism splits: their int4 scale groups
# (one per 32 input columns) are split across the chips with it.
ROW_PARALLEL = (".self_attn.o_proj", ".mlp.down_proj")


def int4_groups_indivisible(geo: Geometry, prefix: str,
                            int4_modules: set[str], tp: int) -> list[str]:
    """The int4 row-parallel modules whose scale groups do not divide by
    the tensor-parallel size (tpu-inference 0.32 then fails deep in its
    weight sharding with a raw JAX IndivisibleError)."""
    if tp <= 1:
        return []
    shapes = geo.expected(prefix)
    out = []
    for module in sorted(int4_modules):
        if module.endswith(ROW_PARALLEL):
            groups = shapes[module + ".weight"][1] // GROUP_SIZE
            if groups % tp:
                out.append(f"{module}: {groups} int4 groups of {GROUP_SIZE} "
                           f"input columns do not split over "
                           f"--tensor-parallel-size {tp}")
    return out


def check_tensor_parallel(report: "CheckpointReport", int4_modules: set[str],
                          tp: int) -> None:
    """One CheckpointError naming the first int4 module that `tp` chips
    cannot split (see int4_groups_indivisible)."""
    bad = int4_groups_indivisible(report.geometry, report.prefix,
                                  int4_modules, tp)
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise CheckpointError(
            f"{bad[0]}{more}; serve it with a tensor-parallel size that "
            "divides the group count, or keep the module bf16")


def bf16_linears_to_int4(report: "CheckpointReport",
                         quant: dict | None) -> set[str]:
    """The bf16 linears a compressed-tensors `quant` config (e.g. from
    --hf-overrides) makes int4 while loading: the -qat-q4_0-unquantized
    export. None for an export already pack-quantized."""
    if report.quantized or not quantization.is_compressed_tensors(quant):
        return set()
    return {m for m in report.geometry.linear_modules(report.prefix)
            if quantization.quantizes(quant, m)}


def gate_up_mismatches(linears, int4_modules: set[str]) -> list[str]:
    """tpu-inference fuses mlp.gate_proj and mlp.up_proj into one linear
    (quantized or not as a unit): both must be int4, or neither."""
    return [f"{gate} and {up} must be both int4 or both bf16 (tpu-inference "
            "fuses them into one linear)"
            for gate in sorted(linears) if gate.endswith(".mlp.gate_proj")
            and (gate in int4_modules) != (
                (up := fused_partner(gate)) in int4_modules)]
