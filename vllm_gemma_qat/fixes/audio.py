"""Audio input on Gemma 4 E2B / E4B, under --load-format gemma_qat only.
Upstream patch: patches/0015-* (write-up: patches/README.md).

tpu-inference 0.32's JAX Gemma 4 has no audio tower: its loader drops the
checkpoint's `audio_tower.*` / `embed_audio.*` tensors and it merges image
embeddings only, so vLLM's Gemma 4 processor (which accepts audio whenever
the config has an `audio_config`) hands the runner features no model reads.
Here, for a checkpoint with an audio tower:

- the model gets `audio_tower` and `embed_audio` (fixes/audio_tower.py,
  which patch 0015 adds to tpu-inference as models/jax/gemma4_audio.py),
  loaded from those tensors by name and shape;
- `embed_multimodal` turns vLLM's `input_features_padded` /
  `input_features_mask` into one embedding per clip: the clip's frames
  padded to a bucket (FRAME_BUCKETS), the tower, the embedder, the valid
  frames; the runner's precompile (`precompile_vision_encoder`, the
  multimodal precompile hook) compiles every bucket;
- the encoders' embeddings are merged at the positions the runner marks
  (`is_multimodal`) rather than wherever a placeholder id appears (by
  reading, not shown by a test: a text request holding the placeholder
  token literally, prefilled in the same step as an audio or image
  request, would shift that request's embeddings by one), and audio soft
  tokens are masked out of the per-layer inputs as image soft tokens are
  (that comparison sees the audio token as the image token);
- the API server refuses (400) an empty clip, one too short for a soft
  token (vLLM gives it none and serves the request without it) and one
  longer than the processor's limit (`audio_seq_length` soft tokens of
  `audio_ms_per_token`: vLLM's Gemma 4 processor only logs a warning and
  gives it fewer placeholders than the tower makes tokens); and, where
  torchaudio is missing, resamples a clip not at 16 kHz with soxr (vLLM's
  default resampler is torchaudio, which vllm-tpu's [audio] extra does not
  install: a 500).
"""
from __future__ import annotations

import functools

from vllm_gemma_qat import substitute
from vllm_gemma_qat.gate import LOAD_FORMAT, is_gemma_qat
from vllm_gemma_qat.substitute import Substitution

TARGET_MODULE = "tpu_inference.models.jax.gemma4_mm"
RENDERER_MODULE = "vllm.renderers.base"
MODEL = f"{TARGET_MODULE}:Gemma4ForConditionalGeneration"
AUDIO_PREFIXES = ("model.audio_tower.", "model.embed_audio.")
# A clip's log-mel frames are padded to one of these (one compiled tower
# program each; the runner's precompile compiles them all): 10 ms frames,
# 30 s (Gemma4Processor's 750 soft tokens of 40 ms) at most. Padding
# frames are masked, so a clip's embeddings do not depend on its bucket.
FRAME_BUCKETS = (128, 256, 512, 1024, 2048, 3072)
MEL_BINS = 128


def install() -> None:
    substitute.apply_on_import(
        TARGET_MODULE, substitutions,
        f"vllm-gemma-qat (--load-format {LOAD_FORMAT} only, audio)")
    substitute.apply_on_import(
        RENDERER_MODULE, request_substitutions,
        f"vllm-gemma-qat (--load-format {LOAD_FORMAT} only, audio requests)")


def request_substitutions() -> list[Substitution]:
    return [Substitution(
        f"{RENDERER_MODULE}:BaseRenderer._process_multimodal",
        _checking_clips, "an empty audio clip, one too short for a soft "
        "token or one longer than the model takes is a 400; without "
        "torchaudio, a clip at another rate is resampled with soxr (not a "
        "500)", wraps=True)]


def substitutions() -> list[Substitution]:
    from tpu_inference.models.jax import gemma4_mm
    if hasattr(gemma4_mm.Gemma4ForConditionalGeneration,
               "get_single_audio_embedding"):
        return []  # tpu-inference with patch 0015: it serves audio itself
    return [
        Substitution(f"{TARGET_MODULE}:Gemma4MmModel.__init__", _with_tower,
                     "a checkpoint with an audio_config gets the audio "
                     "tower and its embedder", wraps=True),
        Substitution(f"{MODEL}.load_weights", _loads_audio,
                     "audio_tower.* / embed_audio.* loaded, not dropped",
                     wraps=True),
        Substitution(f"{MODEL}.embed_multimodal", _embeds_audio,
                     "audio features become embeddings", wraps=True),
        Substitution(f"{MODEL}.precompile_vision_encoder",
                     _precompiles_audio, "the runner's multimodal precompile "
                     "compiles the audio tower for every frame bucket",
                     wraps=True),
        Substitution(f"{MODEL}.embed_input_ids",
                     _merged_at_the_runners_positions,
                     "audio and image embeddings merged at the positions the "
                     "runner marks (is_multimodal), not wherever their token "
                     "ids appear", wraps=True),
        Substitution(f"{MODEL}.__call__", _audio_as_image_token_in_call,
                     "audio soft tokens masked out of the per-layer inputs",
                     wraps=True),
    ]


def wants_tower(vllm_config) -> bool:
    """A checkpoint with an audio tower, served with audio allowed: as
    vLLM's own models do, `--limit-mm-per-prompt '{"audio": 0}'` leaves the
    tower out (its weights are then read and dropped, as tpu-inference
    0.32 drops them)."""
    model_config = vllm_config.model_config
    mm_config = getattr(model_config, "multimodal_config", None)
    return (getattr(model_config.hf_config, "audio_config", None) is not None
            and mm_config is not None
            and mm_config.get_limit_per_prompt("audio") > 0)


def has_audio(model) -> bool:
    return hasattr(model.model, "audio_tower")


def _with_tower(init):

    @functools.wraps(init)
    def wrapped(self, vllm_config, rng, mesh, prefix="model"):
        init(self, vllm_config, rng, mesh, prefix)
        if hasattr(self, "audio_tower"):
            return  # tpu-inference with patch 0015 builds it already
        hf_config = vllm_config.model_config.hf_config
        if wants_tower(vllm_config) and is_gemma_qat(vllm_config):
            audio_config = hf_config.audio_config
            from vllm_gemma_qat.fixes.audio_tower import (AudioEmbedder,
                                                          Gemma4AudioModel)
            dtype = _jax_dtype(vllm_config)
            self.audio_tower = Gemma4AudioModel(audio_config, dtype)
            self.embed_audio = AudioEmbedder(
                audio_config, hf_config.text_config.hidden_size, dtype)

    return wrapped


def _loads_audio(load_weights):

    @functools.wraps(load_weights)
    def wrapped(self, weights):
        if not has_audio(self):
            return load_weights(self, weights)
        from vllm_gemma_qat.fixes.audio_tower import load_audio_weights
        audio = []

        def rest():
            for name, tensor in weights:
                if name.startswith(AUDIO_PREFIXES):
                    audio.append((name, tensor))
                else:
                    yield name, tensor

        loaded = set(load_weights(self, rest()))
        modules = {"model.audio_tower": self.model.audio_tower,
                   "model.embed_audio": self.model.embed_audio}
        return loaded | load_audio_weights(modules, audio)

    return wrapped


def _embeds_audio(embed_multimodal):

    @functools.wraps(embed_multimodal)
    def wrapped(self, **kwargs):
        features = kwargs.pop("input_features_padded", None)
        masks = kwargs.pop("input_features_mask", None)
        if features is None or not has_audio(self):
            return embed_multimodal(self, **kwargs)
        return [audio_embedding(self, f, m) for f, m in zip(features, masks)]

    return wrapped


def audio_embedding(model, features, mask):
    """One clip's embeddings [valid tokens, text hidden]: `features`
    [frames, mel] and `mask` [frames] (torch, in the served dtype as vLLM
    converts them, or numpy; vLLM hands over the valid frames only). The
    tower gets host arrays, as the precompile's dummy clips are, so the
    programs it compiled are the ones found here."""
    import numpy as np
    features, mask = _host_f32(features), _host_f32(mask).astype(bool)
    frames = features.shape[0]
    padded = frame_bucket(frames)
    dtype = np.dtype(_jax_dtype(model.vllm_config))
    features = np.pad(features, ((0, padded - frames), (0, 0)))[None]
    mask = np.pad(mask, (0, padded - frames))[None]
    embeds, valid = _embed_clip()(model.model.audio_tower,
                                  model.model.embed_audio,
                                  features.astype(dtype), mask)
    # The valid frames are a prefix: the tower's mask keeps every other
    # frame twice.
    return embeds[0, :int(np.asarray(valid).sum())]


def _host_f32(x):
    """A torch tensor (bf16 too, which numpy cannot take) or an array as a
    float32 numpy array."""
    import numpy as np
    if hasattr(x, "detach"):
        x = x.detach().float().cpu().numpy()
    return np.asarray(x, dtype=np.float32)


def frame_bucket(frames: int) -> int:
    """The smallest of FRAME_BUCKETS that holds `frames` (beyond the last,
    which the API server's length check keeps out: the frames as they
    are)."""
    return next((b for b in FRAME_BUCKETS if frames <= b), frames)


def _precompiles_audio(precompile_vision_encoder):

    @functools.wraps(precompile_vision_encoder)
    def wrapped(self, run_compilation_fn):
        precompile_vision_encoder(self, run_compilation_fn)
        if not has_audio(self):
            return
        import numpy as np
        dtype = np.dtype(_jax_dtype(self.vllm_config))
        for frames in FRAME_BUCKETS:
            # Host arrays, as the vision precompile's dummy images are.
            run_compilation_fn("audio_encoder", _embed_clip(),
                               self.model.audio_tower, self.model.embed_audio,
                               np.zeros((1, frames, MEL_BINS), dtype),
                               np.ones((1, frames), bool), frames=frames)

    return wrapped


def _jax_dtype(vllm_config):
    """vLLM's --dtype (a torch dtype, or a JAX one once tpu-inference has
    set it) as JAX's."""
    from tpu_inference.utils import to_jax_dtype
    return to_jax_dtype(vllm_config.model_config.dtype)


@functools.cache
def _embed_clip():
    import jax

    @jax.jit
    def embed(tower, embedder, features, mask):
        hidden, valid = tower(features, mask)
        return embedder(hidden), valid

    return embed


def _audio_token_id(model) -> int:
    return model.vllm_config.model_config.hf_config.audio_token_id


def _audio_token_as_image_token(model, input_ids):
    if input_ids is None or not has_audio(model):
        return input_ids
    import jax.numpy as jnp
    return jnp.where(input_ids == _audio_token_id(model),
                     model.image_token_id, input_ids)


def _merged_at_the_runners_positions(embed_input_ids):

    @functools.wraps(embed_input_ids)
    def wrapped(self, input_ids, multimodal_embeddings=None,
                is_multimodal=None, **kwargs):
        if not has_audio(self):
            return embed_input_ids(self, input_ids, multimodal_embeddings,
                                   is_multimodal=is_multimodal, **kwargs)
        import jax.numpy as jnp
        from tpu_inference.models.jax.utils.multi_modal_utils import \
            _merge_multimodal_embeddings
        embeds = embed_input_ids(self, input_ids, None, **kwargs)
        if multimodal_embeddings is None or \
                multimodal_embeddings.shape[0] == 0:
            return embeds
        if is_multimodal is None:
            is_multimodal = jnp.isin(input_ids, jnp.array(
                [self.image_token_id, _audio_token_id(self)]))
        return _merge_multimodal_embeddings(
            embeds, is_multimodal, multimodal_embeddings).astype(embeds.dtype)

    return wrapped


def _audio_as_image_token_in_call(call):

    @functools.wraps(call)
    def wrapped(self, kv_caches, input_ids, *args, **kwargs):
        return call(self, kv_caches,
                    _audio_token_as_image_token(self, input_ids), *args,
                    **kwargs)

    return wrapped


def _checking_clips(process_multimodal):

    @functools.wraps(process_multimodal)
    def wrapped(self, prompt, mm_data, *args, **kwargs):
        clips = (mm_data or {}).get("audio")
        if clips is not None and is_gemma_qat(self.config):
            mm_data = {**mm_data, "audio": checked_clips(
                clips, self.get_mm_processor().info)}
        return process_multimodal(self, prompt, mm_data, *args, **kwargs)

    return wrapped


def checked_clips(clips, info) -> list:
    """The request's clips, each checked against the model's processing
    (`info`: vLLM's Gemma4ProcessingInfo): a ValueError (vLLM's API server
    answers 400) names the first that is empty, too short for one soft
    token (vLLM would give it none, and drop it) or longer than the model
    takes. A clip is what vLLM's parser takes: samples (an array, samples
    last; a list of numbers) or (samples, rate); None (a cached item)
    passes as it is.
    Without torchaudio (vLLM's default resampler, which vllm-tpu's [audio]
    extra lacks), a clip at another rate is resampled here with soxr
    (vLLM's `soxr` method): vLLM would fail on it with a 500."""
    import math

    import numpy as np
    processor = info.get_hf_processor()
    rate = processor.feature_extractor.sampling_rate
    limit_s = processor.audio_seq_length * processor.audio_ms_per_token / 1000
    if not isinstance(clips, list) or (
            clips and isinstance(clips[0], (int, float))):
        clips = [clips]
    out = []
    for i, clip in enumerate(clips):
        if clip is None:
            out.append(clip)
            continue
        samples, clip_rate = (clip if isinstance(clip, tuple) else
                              (clip, rate))
        samples = np.asarray(samples)
        seconds = samples.shape[-1] / clip_rate
        if samples.size == 0:
            raise ValueError(f"audio clip {i + 1} is empty (no samples)")
        if info._compute_audio_num_tokens(
                round(seconds * rate), rate, processor.audio_seq_length) < 1:
            raise ValueError(
                f"audio clip {i + 1} is too short ({seconds * 1000:.1f} ms): "
                "it makes no audio soft token")
        if seconds > limit_s:
            raise ValueError(
                f"audio clip {i + 1} lasts {seconds:.2f} s; this model "
                f"takes at most {limit_s:.2f} s ({processor.audio_seq_length}"
                f" soft tokens of {processor.audio_ms_per_token} ms)")
        if not math.isclose(clip_rate, rate) and not _has_torchaudio():
            from vllm.multimodal.audio import resample_audio_soxr
            clip = (resample_audio_soxr(samples, orig_sr=clip_rate,
                                        target_sr=rate), rate)
        out.append(clip)
    return out


def _has_torchaudio() -> bool:
    import importlib.util
    return importlib.util.find_spec("torchaudio") is not None
