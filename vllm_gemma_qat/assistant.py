"""What a Gemma 4 assistant (the MTP drafter of `--speculative-config
'{"model": ASSISTANT, ...}'`) must contain, and whether it fits its target,
from config.json and the safetensors headers alone.

transformers' `Gemma4AssistantForCausalLM` (model_type `gemma4_assistant`):
a small Gemma 4 text model whose layers are all KV-shared and Q-only (no
k_proj / v_proj / k_norm): each reads the target's cache, from the target's
last non-shared layer of the same attention type (tpu-inference's
`compute_mtp_kv_share_map`). So per attention type its head dim and KV heads
must be that layer's, and its sliding window the target's;
`pre_projection` takes [token embedding, target hidden state], both of the
target's hidden size (`backbone_hidden_size`), and its vocabulary is the
target's. Centroid masking (`use_ordered_embeddings`) adds
`masked_embedding.centroids` and `masked_embedding.token_ordering`.

`check` compares the headers with that; every mismatch names both values,
and `CheckpointReport.raise_if_invalid` makes them one `CheckpointError`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from vllm_gemma_qat import geometry
from vllm_gemma_qat.checkpoint import Checkpoint, CheckpointError

ARCHITECTURE = "Gemma4AssistantForCausalLM"
MODEL_TYPE = "gemma4_assistant"
# Tensors outside the text model (transformers' names).
PROJECTIONS = ("pre_projection.weight", "post_projection.weight")


def not_an_assistant(draft: str, config: dict) -> CheckpointError:
    """The error for a drafter gemma_qat would be asked to load that is not
    a Gemma 4 assistant."""
    return CheckpointError(
        f"draft model {draft}: architectures {config.get('architectures')} "
        f"(model_type {config.get('model_type')!r}) is not a Gemma 4 "
        f"assistant ({ARCHITECTURE}), the one drafter --load-format gemma_qat "
        "loads; give another drafter its own loader in --speculative-config: "
        '"draft_load_config": {"load_format": "auto"}')


def is_assistant(config: dict) -> bool:
    return (ARCHITECTURE in (config.get("architectures") or [])
            or config.get("model_type") == MODEL_TYPE)


@dataclass
class AssistantReport:
    path: str
    target: str
    geometry: geometry.Geometry
    expected: dict[str, tuple[int, ...]]
    errors_: list[str] = field(default_factory=list)
    tensors: int = 0

    def errors(self) -> list[str]:
        return self.errors_

    @property
    def skipped(self) -> list[str]:
        return []  # an assistant ships nothing it does not use

    @property
    def loads_with_gemma_qat(self) -> bool:
        return not self.errors_

    def raise_if_invalid(self) -> None:
        errs = self.errors_
        if errs:
            more = f" (and {len(errs) - 5} more)" if len(errs) > 5 else ""
            raise CheckpointError(
                f"assistant {self.path} does not fit target {self.target}: "
                + "; ".join(errs[:5]) + more)


def assistant_geometry(text: dict) -> geometry.Geometry:
    """The assistant's text config as a Geometry whose layers are all
    KV-shared (their K/V source is the target's, not a layer of its own:
    marked -1)."""
    for key in ("num_hidden_layers", "hidden_size", "num_attention_heads",
                "head_dim", "intermediate_size", "vocab_size"):
        if key not in text:
            raise CheckpointError(f"config.json: text config lacks {key!r}")
    n = text["num_hidden_layers"]
    layer_types = tuple(text.get("layer_types") or ())
    if len(layer_types) != n:
        raise CheckpointError(f"config.json: layer_types has "
                              f"{len(layer_types)} entries, num_hidden_layers "
                              f"is {n}")
    return geometry.Geometry(text, layer_types, {i: -1 for i in range(n)})


def _target_owner_layers(target_geo: geometry.Geometry) -> dict[str, int]:
    """Per attention type, the target layer whose cache the assistant's
    layers of that type read: the last non-shared one
    (`compute_mtp_kv_share_map`)."""
    out = {}
    for i, kind in enumerate(target_geo.layer_types):
        if i not in target_geo.kv_share_map:
            out[kind] = i
    return out


def fit_errors(config: dict, target_config: dict) -> list[str]:
    """How the assistant's config.json disagrees with its target's (each
    naming both values); [] when it fits."""
    if not is_assistant(config):
        arch = config.get("architectures")
        return [f"config.json: architectures {arch} (model_type "
                f"{config.get('model_type')!r}) is not a Gemma 4 assistant "
                f"({ARCHITECTURE}, model_type {MODEL_TYPE!r})"]
    text = geometry.text_config_of(config)
    target_text = geometry.text_config_of(target_config)
    try:
        geo = assistant_geometry(text)
    except CheckpointError as e:
        return [str(e)]
    target_geo = geometry.Geometry.from_text_config(target_text)
    out = []
    n = geo.num_layers
    shared = text.get("num_kv_shared_layers") or 0
    if shared != n:
        out.append(f"num_kv_shared_layers is {shared}, but an assistant's "
                   f"{n} layers must all be KV-shared (num_kv_shared_layers "
                   f"= num_hidden_layers = {n})")
    for key, what in (("hidden_size_per_layer_input", "per-layer inputs"),
                      ("vocab_size_per_layer_input", "per-layer inputs")):
        if text.get(key):
            out.append(f"{key} is {text[key]}: an assistant has no {what} "
                       "(0)")
    if text.get("use_double_wide_mlp"):
        out.append("use_double_wide_mlp is true: an assistant has none")
    backbone = config.get("backbone_hidden_size")
    if backbone != target_text["hidden_size"]:
        out.append(f"backbone_hidden_size is {backbone}, the target's "
                   f"hidden_size is {target_text['hidden_size']}")
    if text["vocab_size"] != target_text["vocab_size"]:
        out.append(f"vocab_size is {text['vocab_size']}, the target's is "
                   f"{target_text['vocab_size']}")
    owners = _target_owner_layers(target_geo)
    windows_checked = False
    for i, kind in enumerate(geo.layer_types):
        if kind not in owners:
            out.append(f"layer {i} is {kind}, but the target has no "
                       f"non-shared {kind} layer to read K/V from")
            continue
        j = owners[kind]
        for what, mine, theirs in (
                ("head_dim", geo.head_dim(i), target_geo.head_dim(j)),
                ("KV heads", geo.kv_heads(i), target_geo.kv_heads(j))):
            if mine != theirs:
                out.append(f"layer {i} ({kind}) has {what} {mine}, the "
                           f"target's layer {j} whose cache it reads has "
                           f"{theirs}")
        if kind == "sliding_attention" and not windows_checked:
            windows_checked = True
            if text.get("sliding_window") != target_text.get("sliding_window"):
                out.append(f"sliding_window is {text.get('sliding_window')}, "
                           f"the target's is {target_text.get('sliding_window')}")
    if config.get("use_ordered_embeddings"):
        c = config.get("num_centroids") or 0
        if not c or text["vocab_size"] % c:
            out.append(f"use_ordered_embeddings: num_centroids {c} does not "
                       f"divide vocab_size {text['vocab_size']}")
    return out


def expected_tensors(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of the assistant (transformers' names and [out, in]
    shapes); `lm_head.weight` is tied to `model.embed_tokens.weight`."""
    text = geometry.text_config_of(config)
    geo = assistant_geometry(text)
    h, bb = text["hidden_size"], config["backbone_hidden_size"]
    out = {f"model.{k}": s for k, s in geo.global_tensors().items()}
    for i in range(geo.num_layers):
        for k, s in geo.layer_tensors(i).items():
            out[f"model.layers.{i}.{k}"] = s
    out["pre_projection.weight"] = (h, 2 * bb)
    out["post_projection.weight"] = (bb, h)
    if config.get("use_ordered_embeddings"):
        out["masked_embedding.centroids.weight"] = (config["num_centroids"], h)
        out["masked_embedding.token_ordering"] = (text["vocab_size"], )
    return out


def check(ckpt: Checkpoint, target_config: dict, target: str = "the target"
          ) -> AssistantReport:
    """Compare an assistant checkpoint with its target's config.json and
    with what it must contain; nothing is skipped, nothing quantized."""
    errors = fit_errors(ckpt.config, target_config)
    if errors and not is_assistant(ckpt.config):
        return AssistantReport(str(ckpt.path), target, None, {}, errors)
    text = geometry.text_config_of(ckpt.config)
    try:
        geo = assistant_geometry(text)
        expected = expected_tensors(ckpt.config)
    except (CheckpointError, KeyError) as e:
        return AssistantReport(str(ckpt.path), target, None, {},
                               errors + [str(e)])
    seen = set()
    for name, info in ckpt.tensors.items():
        if name == "lm_head.weight":
            continue  # tied; tolerated either way
        if name not in expected:
            what = ("a K/V tensor: an assistant's layers are Q-only"
                    if name.split(".")[-2] in ("k_proj", "v_proj", "k_norm")
                    else "not an assistant tensor")
            errors.append(f"unexpected tensor {name} ({what})")
            continue
        seen.add(name)
        if tuple(info.shape) != expected[name]:
            errors.append(f"tensor {name} has shape {list(info.shape)}, "
                          f"expected {list(expected[name])}")
        if info.dtype not in ("BF16", "F32", "F16") and not name.endswith(
                "token_ordering"):
            errors.append(f"tensor {name} is {info.dtype}: the assistant is "
                          "served unquantized (bf16 / fp32 values)")
    errors += [f"missing tensor {n} (expected shape {list(s)})"
               for n, s in expected.items() if n not in seen]
    return AssistantReport(str(ckpt.path), target, geo, expected, errors,
                           len(ckpt.tensors))
