"""Serve Gemma 4 QAT exports on TPU through vLLM: `--load-format gemma_qat`.

`register` is the `vllm.general_plugins` entry point. vLLM calls it in the
API server, the engine core and every worker, so it is idempotent and cheap:
it registers the loader and arranges for tpu-inference's Gemma 4 module to be
patched when (and if) it is imported.

Layout (imports go one way, down this list):
  checkpoint, quantization, geometry  header-only: what a checkpoint holds
                                      and what gemma_qat needs of it
  int4, weights, loader               reading tensors into the model
  substitute, kv_share_patch          runtime changes to tpu-inference
  plan, cli                           `vllm-gemma-qat inspect | plan | ...`
  cpu/       opt-in CPU mode (its own entry point): kernel stand-ins,
             substitution table, a `vllm serve` wrapper
  testing/   tiny and header-only checkpoints, a model runner, the demo
"""
__version__ = "0.1.0"

LOAD_FORMAT = "gemma_qat"


def register() -> None:
    from vllm.model_executor.model_loader import (_LOAD_FORMAT_TO_MODEL_LOADER,
                                                  register_model_loader)

    from vllm_gemma_qat import kv_share_patch
    from vllm_gemma_qat.loader import GemmaQatModelLoader

    if _LOAD_FORMAT_TO_MODEL_LOADER.get(LOAD_FORMAT) is not GemmaQatModelLoader:
        register_model_loader(LOAD_FORMAT)(GemmaQatModelLoader)
    kv_share_patch.install()
