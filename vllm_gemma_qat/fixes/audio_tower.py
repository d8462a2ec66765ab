"""Gemma 4's audio tower and its embedder in JAX, as transformers'
`Gemma4AudioModel` and `Gemma4MultimodalEmbedder` (modeling_gemma4.py)
define them: two stride-2 convolutions over the log-mel frames, conformer
layers (half-step feed-forward, chunked local self-attention with
relative positions and a logit cap, a causal depthwise convolution, a
second feed-forward), the output projection, then the embedder's norm and
projection into the text model's width.

Every parameter keeps its checkpoint name and layout (`model.audio_tower.*`,
`model.embed_audio.*`; linears as [out, in], convolutions as OIHW / OIW),
so loading is one lookup per tensor (`load_audio_weights`). The clipped
linears' bounds (`input_min` ... `output_max`) are checkpoint tensors and
are applied. Attention runs in float32 as transformers runs it; the rest in
the parameters' dtype. The tower is small (E2B: ~0.3 B parameters) and is
held whole on every chip.
"""
from __future__ import annotations

import math
from typing import Iterable

import jax
import jax.numpy as jnp
from flax import nnx
from tpu_inference.layers.jax import JaxModule, JaxModuleList

CLIP_BOUNDS = ("input_min", "input_max", "output_min", "output_max")
# Attention is float32 in transformers; a TPU would run f32 dots at bf16
# passes by default.
HIGHEST = jax.lax.Precision.HIGHEST


def _param(shape, dtype, fill: float = 0.0) -> nnx.Param:
    # A weight_loader of its own: tpu-inference's JaxAutoWeightsLoader
    # would otherwise give names like `relative_k_proj.weight` its
    # attention-head reshapes.
    return nnx.Param(jnp.full(shape, fill, dtype),
                     weight_loader=load_as_stored)


def load_as_stored(param: nnx.Param, tensor, name: str = "") -> None:
    """A checkpoint tensor into `param` in its stored layout, in the
    parameter's dtype; a shape that differs is an error naming it."""
    from tpu_inference.models.jax.utils.weight_utils import \
        load_nnx_param_from_reshaped_torch
    from tpu_inference.utils import to_torch_dtype
    shape = tuple(param.get_value().shape)
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name}: shape {tuple(tensor.shape)} in the "
                         f"checkpoint, the audio tower's config gives {shape}")
    load_nnx_param_from_reshaped_torch(
        param, tensor.to(to_torch_dtype(param.get_value().dtype)),
        permute_dims=(0, 1) if tensor.ndim == 2 else None, param_name=name)


def _rms_norm(x, weight, eps):
    x32 = x.astype(jnp.float32)
    out = x32 * jnp.power(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps,
                          -0.5)
    if weight is not None:
        out = out * weight.astype(jnp.float32)
    return out.astype(x.dtype)


class RmsNorm(JaxModule):

    def __init__(self, dim: int, dtype, eps: float = 1e-6,
                 with_scale: bool = True):
        self.eps = eps
        if with_scale:
            self.weight = _param((dim, ), dtype)

    def __call__(self, x):
        return _rms_norm(x, getattr(self, "weight", None), self.eps)


class ClippableLinear(JaxModule):
    """`linear.weight` [out, in], and the checkpoint's clip bounds."""

    def __init__(self, in_features: int, out_features: int, dtype,
                 clipped: bool):
        self.linear = Linear(in_features, out_features, dtype)
        self.clipped = clipped
        if clipped:  # unbounded until loaded, as transformers starts them
            for bound in CLIP_BOUNDS:
                setattr(self, bound, _param(
                    (), jnp.float32, -jnp.inf if "min" in bound else jnp.inf))

    def __call__(self, x):
        if self.clipped:
            x = jnp.clip(x, self.input_min.value.astype(x.dtype),
                         self.input_max.value.astype(x.dtype))
        x = self.linear(x)
        if self.clipped:
            x = jnp.clip(x, self.output_min.value.astype(x.dtype),
                         self.output_max.value.astype(x.dtype))
        return x


class Linear(JaxModule):

    def __init__(self, in_features: int, out_features: int, dtype,
                 bias: bool = False):
        self.weight = _param((out_features, in_features), dtype)
        if bias:
            self.bias = _param((out_features, ), dtype)

    def __call__(self, x):
        w = self.weight.value
        out = jnp.einsum("...i,oi->...o", x.astype(w.dtype), w)
        if hasattr(self, "bias"):
            out = out + self.bias.value
        return out


class SubSampleLayer(JaxModule):
    """Conv2d 3x3 stride 2 (no bias), LayerNorm over channels (no bias),
    ReLU; the frame mask keeps every other frame."""

    def __init__(self, in_channels: int, out_channels: int, eps: float,
                 dtype):
        self.conv = JaxModule()
        self.conv.weight = _param((out_channels, in_channels, 3, 3), dtype)
        self.norm = JaxModule()
        self.norm.weight = _param((out_channels, ), dtype)
        self.eps = eps

    def __call__(self, x, mask):
        x = x * mask[:, None, :, None].astype(x.dtype)
        w = self.conv.weight.value
        x = jax.lax.conv_general_dilated(
            x.astype(w.dtype), w, window_strides=(2, 2),
            padding=((1, 1), (1, 1)),
            dimension_numbers=("NCHW", "OIHW", "NCHW"))
        x = jnp.moveaxis(x, 1, -1)  # [B, T, F, C]
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        x = ((x32 - mean) * jax.lax.rsqrt(var + self.eps) *
             self.norm.weight.value.astype(jnp.float32)).astype(x.dtype)
        x = jnp.maximum(x, 0)
        return jnp.moveaxis(x, -1, 1), mask[:, ::2]


class SubSampleConvProjection(JaxModule):

    def __init__(self, config, dtype):
        c0, c1 = config.subsampling_conv_channels
        self.layer0 = SubSampleLayer(1, c0, config.rms_norm_eps, dtype)
        self.layer1 = SubSampleLayer(c0, c1, config.rms_norm_eps, dtype)
        self.input_proj_linear = Linear((c0 // 4) * c1, config.hidden_size,
                                        dtype)

    def __call__(self, features, mask):
        x, mask = self.layer0(features[:, None], mask)
        x, mask = self.layer1(x, mask)
        b, _, t, _ = x.shape
        x = jnp.transpose(x, (0, 2, 3, 1)).reshape(b, t, -1)
        return self.input_proj_linear(x), mask


class FeedForward(JaxModule):

    def __init__(self, config, dtype):
        d, clipped = config.hidden_size, config.use_clipped_linears
        self.ffw_layer_1 = ClippableLinear(d, 4 * d, dtype, clipped)
        self.ffw_layer_2 = ClippableLinear(4 * d, d, dtype, clipped)
        self.pre_layer_norm = RmsNorm(d, dtype)
        self.post_layer_norm = RmsNorm(d, dtype)
        self.clip = config.gradient_clipping
        self.residual_weight = config.residual_weight

    def __call__(self, x):
        residual = x
        h = self.pre_layer_norm(_clamp(x, self.clip))
        h = self.ffw_layer_2(jax.nn.silu(self.ffw_layer_1(h)))
        h = self.post_layer_norm(_clamp(h, self.clip))
        return residual + h * self.residual_weight


def _clamp(x, limit):
    limit = min(limit, float(jnp.finfo(x.dtype).max))
    return jnp.clip(x, -limit, limit)


class Attention(JaxModule):
    """Chunked local attention: a query sees itself, the `left - 2` frames
    before it and the `right - 1` after it (transformers' window on
    `attention_context_left - 1` / `attention_context_right`), with
    Transformer-XL relative positions (sinusoids projected by
    relative_k_proj) and a tanh cap; keys are gathered chunk by chunk."""

    def __init__(self, config, dtype):
        d, heads = config.hidden_size, config.num_attention_heads
        clipped = config.use_clipped_linears
        self.heads, self.head_dim = heads, d // heads
        self.chunk = config.attention_chunk_size
        self.past = config.attention_context_left - 1
        self.future = config.attention_context_right
        self.context = self.chunk + self.past + self.future
        self.cap = config.attention_logit_cap
        self.invalid = config.attention_invalid_logits_value
        self.q_scale = (self.head_dim**-0.5) / math.log(2)
        self.k_scale = math.log(1 + math.e) / math.log(2)
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(self, name, ClippableLinear(d, d, dtype, clipped))
        self.post = ClippableLinear(d, d, dtype, clipped)
        self.relative_k_proj = Linear(d, d, dtype)
        self.per_dim_scale = _param((self.head_dim, ), dtype)

    def _blocks(self, x):
        """[B, T, H, D] -> [B, N, chunk, H, D]: the query chunks."""
        b, t, h, d = x.shape
        n = -(-t // self.chunk)
        x = jnp.pad(x, ((0, 0), (0, n * self.chunk - t), (0, 0), (0, 0)))
        return x.reshape(b, n, self.chunk, h, d)

    def _contexts(self, x):
        """[B, T, H, D] -> [B, N, context, H, D]: each chunk's keys."""
        b, t, h, d = x.shape
        n = -(-t // self.chunk)
        x = jnp.pad(x, ((0, 0), (self.past, self.future + self.chunk - 1),
                        (0, 0), (0, 0)))
        index = (jnp.arange(n)[:, None] * self.chunk +
                 jnp.arange(self.context)[None, :])
        return x[:, index]

    def _rel_shift(self, x):
        b, h, n, c, p = x.shape
        x = jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, 0),
                        (0, self.context + 1 - p)))
        x = x.reshape(b, h, n, c * (self.context + 1))
        x = x[..., :c * self.context]
        return x.reshape(b, h, n, c, self.context)

    def __call__(self, x, position_embeddings, mask):
        b, t, _ = x.shape
        shape = (b, t, self.heads, self.head_dim)
        q = self.q_proj(x).astype(jnp.float32).reshape(shape)
        k = self.k_proj(x).astype(jnp.float32).reshape(shape)
        v = self.v_proj(x).astype(jnp.float32).reshape(shape)
        # softplus in the parameter's dtype, as transformers computes it
        q = q * self.q_scale * jax.nn.softplus(
            self.per_dim_scale.value).astype(jnp.float32)
        k = k * self.k_scale
        q, k, v = self._blocks(q), self._contexts(k), self._contexts(v)
        n = q.shape[1]
        rel = self.relative_k_proj(position_embeddings)
        rel = rel.reshape(-1, self.heads, self.head_dim).astype(jnp.float32)
        ac = jnp.einsum("bnchd,bnkhd->bhnck", q, k, precision=HIGHEST)
        bd = jnp.einsum("bnchd,phd->bhncp", q, rel, precision=HIGHEST)
        logits = ac + self._rel_shift(bd)
        logits = jnp.tanh(logits / self.cap) * self.cap
        logits = jnp.where(mask[:, None], logits, self.invalid)
        weights = jax.nn.softmax(logits, axis=-1)
        out = jnp.einsum("bhnck,bnkhd->bnchd", weights, v,
                         precision=HIGHEST)
        out = out.reshape(b, n * self.chunk, -1)[:, :t]
        return self.post(out.astype(x.dtype))

    def blocked_mask(self, frame_mask):
        """[B, T] valid frames -> [B, N, chunk, context]: query i of chunk n
        may see key (n * chunk + j - past) when that frame is valid and
        within `past` frames back or `future` ahead (transformers'
        sliding_window_mask_function, then its blocked gather)."""
        b, t = frame_mask.shape
        n = -(-t // self.chunk)
        q = jnp.arange(n)[:, None, None] * self.chunk + jnp.arange(
            self.chunk)[None, :, None]
        k = (jnp.arange(n)[:, None, None] * self.chunk - self.past +
             jnp.arange(self.context)[None, None, :])
        dist = q - k
        window = (((dist >= 0) & (dist < self.past)) |
                  ((dist < 0) & (-dist < self.future)))
        inside = (k >= 0) & (k < t) & (q < t)
        valid = jnp.take(frame_mask, jnp.clip(k, 0, t - 1), axis=1)
        return valid & (window & inside)[None]


class LightConv1d(JaxModule):

    def __init__(self, config, dtype):
        d, clipped = config.hidden_size, config.use_clipped_linears
        self.linear_start = ClippableLinear(d, 2 * d, dtype, clipped)
        self.linear_end = ClippableLinear(d, d, dtype, clipped)
        self.depthwise_conv1d = JaxModule()
        self.depthwise_conv1d.weight = _param((d, 1, config.conv_kernel_size),
                                              dtype)
        self.pre_layer_norm = RmsNorm(d, dtype, config.rms_norm_eps)
        self.conv_norm = RmsNorm(d, dtype, config.rms_norm_eps)
        self.clip = config.gradient_clipping

    def __call__(self, x):
        residual = x
        h = self.linear_start(self.pre_layer_norm(x))
        half = h.shape[-1] // 2
        h = h[..., :half] * jax.nn.sigmoid(h[..., half:])
        w = self.depthwise_conv1d.weight.value  # [D, 1, K]
        h = jnp.pad(h, ((0, 0), (w.shape[-1] - 1, 0), (0, 0)))
        h = jax.lax.conv_general_dilated(
            h.astype(w.dtype), w, window_strides=(1, ), padding="VALID",
            dimension_numbers=("NWC", "OIW", "NWC"),
            feature_group_count=w.shape[0])
        h = self.conv_norm(_clamp(h, self.clip))
        return residual + self.linear_end(jax.nn.silu(h))


class ConformerLayer(JaxModule):

    def __init__(self, config, dtype):
        d = config.hidden_size
        self.feed_forward1 = FeedForward(config, dtype)
        self.feed_forward2 = FeedForward(config, dtype)
        self.self_attn = Attention(config, dtype)
        self.lconv1d = LightConv1d(config, dtype)
        self.norm_pre_attn = RmsNorm(d, dtype)
        self.norm_post_attn = RmsNorm(d, dtype)
        self.norm_out = RmsNorm(d, dtype)
        self.clip = config.gradient_clipping

    def __call__(self, x, position_embeddings, mask):
        x = self.feed_forward1(x)
        residual = x
        h = self.norm_pre_attn(_clamp(x, self.clip))
        h = self.self_attn(h, position_embeddings, mask)
        x = residual + self.norm_post_attn(_clamp(h, self.clip))
        x = self.feed_forward2(self.lconv1d(x))
        return self.norm_out(_clamp(x, self.clip))


class Gemma4AudioModel(JaxModule):

    def __init__(self, config, dtype):
        if config.hidden_act != "silu":
            raise ValueError(f"audio_config.hidden_act: {config.hidden_act!r}"
                             "; Gemma 4's audio tower is built with silu")
        self.config = config
        self.subsample_conv_projection = SubSampleConvProjection(config, dtype)
        self.layers = JaxModuleList([
            ConformerLayer(config, dtype)
            for _ in range(config.num_hidden_layers)
        ])
        self.output_proj = Linear(config.hidden_size, config.output_proj_dims,
                                  dtype, bias=True)

    def position_embeddings(self, dtype):
        """Sinusoids for relative distances context // 2 ... 0."""
        d = self.config.hidden_size
        context = self.layers[0].self_attn.context
        n = d // 2
        inv = jnp.exp(jnp.arange(n, dtype=jnp.float32) *
                      -(math.log(10000.0) / max(n - 1, 1)))
        positions = jnp.arange(context // 2, -1, -1, dtype=jnp.float32)
        scaled = positions[:, None] * inv[None, :]
        return jnp.concatenate([jnp.sin(scaled), jnp.cos(scaled)],
                               axis=-1).astype(dtype)

    def __call__(self, features, frame_mask):
        """features [B, T, mel], frame_mask [B, T] -> ([B, T', out], [B, T'])
        with T' = ceil(ceil(T / 2) / 2)."""
        x, mask = self.subsample_conv_projection(features, frame_mask)
        positions = self.position_embeddings(x.dtype)
        blocked = self.layers[0].self_attn.blocked_mask(mask)
        for layer in self.layers:
            x = layer(x, positions, blocked)
        return self.output_proj(x), mask


class AudioEmbedder(JaxModule):
    """The tower's output into the text model's width: a scale-free RMS
    norm, then `embedding_projection` ([text hidden, output_proj_dims])."""

    def __init__(self, audio_config, text_hidden: int, dtype):
        self.eps = audio_config.rms_norm_eps
        self.embedding_projection = Linear(audio_config.output_proj_dims,
                                           text_hidden, dtype)

    def __call__(self, x):
        return self.embedding_projection(_rms_norm(x, None, self.eps))


def load_audio_weights(modules: dict[str, JaxModule],
                       weights: Iterable[tuple[str, object]]) -> set[str]:
    """Put each (checkpoint name, torch tensor) into the parameter of that
    name under `modules` ({"model.audio_tower": tower, "model.embed_audio":
    embedder}), as stored. Raises on a name no parameter has, on a shape
    that differs and on parameters no tensor was given for, naming them.
    Returns the names loaded."""
    params = {f"{prefix}.{name}": param
              for prefix, module in modules.items()
              for name, param in module.named_parameters()}
    loaded = set()
    for name, tensor in weights:
        if name not in params:
            raise ValueError(f"{name}: no parameter of Gemma 4's audio tower "
                             "or embedder has this name")
        load_as_stored(params[name], tensor, name)
        loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"the checkpoint has no tensor for {len(missing)} "
                         f"audio parameters: {', '.join(missing[:8])}")
    return loaded
