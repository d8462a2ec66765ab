"""The plugin's run-time fixes to tpu-inference 0.32, one module per upstream
bug, each the twin of a patch in `patches/` (write-ups: patches/README.md).
Each acts only under `--load-format gemma_qat` (`vllm_gemma_qat.gate`).

| module | patch | fixes |
| --- | --- | --- |
| `kv_share` | 0001 | #3225: KV-shared layers built with no K/V (and the structural guard; an ignored fused gate_up under compressed-tensors) |
| `image_steps` | 0002 | image steps keep their token ids; pixel values converted by value |
| `preemption` | 0003 | resumed requests keep their real output tokens (async scheduling) |
| `compile_once` | 0004 | a weight load clears JAX's caches once, not per module |
| `weight_dtype` | 0005 | floating-point weights loaded in the served dtype |
| `drafter_load` | 0006 | speculative decoding: the drafter loaded with `draft_load_config` when given (else the target's loader: gemma_qat's checks and loads a Gemma 4 assistant) |
| `drafter_quantization` | 0007 | speculative decoding: the drafter built with its own quantization config, not the target's |
| `sliding_window` | 0008 | #3220: sliding layers keep only their window's KV blocks (two sliding layers per row of the full layers' shape) |
| `discarded_samples` | 0009 | speculative decoding under async scheduling: a request whose samples a step discards (a chunk of a resumed request's recompute) gets no placeholder token |
| `request_checks` | 0010 | `prompt_logprobs` on a multimodal model or with a drafter: a 400 from the API server, not an engine that dies |
| `text_only` | 0011 | a text-only checkpoint as transformers saves it (bare `gemma4_text` config, tensors under `model.`) builds and loads |
| `rejection_padding` | 0012 | speculative decoding: padded draft positions no longer count as the last request's, which lost its bonus token |
| `int4_tiling` | 0013 | int4 linears: gmm_v2 tiles with one M bucket, N tiles bounded (a weight tile of at most 128 MXU blocks; prefill-sized steps also max(4 M, 2 widths) columns): less TPU code, the int4 512-token step fits a v5e-1 |
| `int4_scales` | 0014 | int4 linears: gmm_v2's scales held in f32 from load, not converted from bf16 by every call of every step |
| `audio` | 0015 | audio input: the conformer audio tower and its embedder (`audio_tower.py`), loaded from the checkpoint, their embeddings merged at the audio soft tokens; an empty, too short or over-long clip is a 400, a clip at another rate is resampled without torchaudio |

`register` installs those in `ALL` (substitutions made when their
tpu-inference module is imported); `weight_dtype` is applied by the loader's
`WeightFeed` as it hands tensors over. This package imports no module of its
own until asked: `weights` uses `weight_dtype` without pulling in vLLM.

`VLLM_GEMMA_QAT_WITHOUT_FIX=name[,name]` leaves those fixes of `ALL` out, in
CPU mode only: how `tests/test_evidence.py` shows each serving check failing
on the bug its fix removes.
"""
from __future__ import annotations

import importlib
import logging
import os

logger = logging.getLogger(__name__)

# Installed by `register`, in this order.
ALL = ("kv_share", "preemption", "image_steps", "compile_once",
       "drafter_load", "drafter_quantization", "sliding_window",
       "discarded_samples", "request_checks", "text_only",
       "rejection_padding", "int4_tiling", "int4_scales", "audio")


def modules() -> list:
    return [importlib.import_module(f"{__name__}.{name}") for name in ALL]


WITHOUT_ENV = "VLLM_GEMMA_QAT_WITHOUT_FIX"
# vllm_gemma_qat.cpu.CPU_MODE_ENV, read here by name: the plugin does not
# import CPU mode (imports go the other way).
CPU_MODE_ENV = "VLLM_GEMMA_QAT_CPU_MODE"


def install_all(without: tuple[str, ...] = ()) -> None:
    """Each fix in `ALL` patches its tpu-inference module now if imported,
    else right after its import (cheap: nothing of tpu-inference is
    imported here), except those an evidence run leaves out (`without`,
    from `left_out()`)."""
    for name, module in zip(ALL, modules()):
        if name in without:
            logger.warning("vllm-gemma-qat: fix %s left out (%s, an evidence "
                           "run: the bug it fixes is back)", name, WITHOUT_ENV)
            continue
        module.install()


def left_out() -> tuple[str, ...]:
    """The fixes VLLM_GEMMA_QAT_WITHOUT_FIX names: each must be in `ALL`,
    and the variable is refused outside CPU mode on JAX's CPU backend (a
    TPU serves with every fix)."""
    value = os.environ.get(WITHOUT_ENV, "")
    names = tuple(name.strip() for name in value.split(",") if name.strip())
    if not names:
        return ()
    unknown = [name for name in names if name not in ALL]
    if unknown:
        raise ValueError(f"{WITHOUT_ENV}={value!r}: no fix named "
                         f"{', '.join(unknown)} (known: {', '.join(ALL)})")
    if (os.environ.get(CPU_MODE_ENV) != "1"
            or os.environ.get("JAX_PLATFORMS") != "cpu"):
        raise ValueError(f"{WITHOUT_ENV}={value!r} leaves fixes out for "
                         f"evidence runs in CPU mode ({CPU_MODE_ENV}=1, "
                         f"JAX_PLATFORMS=cpu) only; unset it to serve")
    return names
