"""Serve Gemma 4 QAT exports on TPU through vLLM: `--load-format gemma_qat`.

`register` is the `vllm.general_plugins` entry point. vLLM calls it in the
API server, the engine core and every worker, so it is idempotent and cheap:
it registers the loader and arranges for tpu-inference's Gemma 4 module to be
patched when (and if) it is imported.

Layout: README.md, section Layout.
"""
__version__ = "0.1.0"

from vllm_gemma_qat.gate import LOAD_FORMAT  # re-exported: the name users know


def register() -> None:
    from vllm.model_executor.model_loader import (_LOAD_FORMAT_TO_MODEL_LOADER,
                                                  register_model_loader)

    from vllm_gemma_qat import fixes, preflight, substitute
    from vllm_gemma_qat.loader import GemmaQatModelLoader

    without = fixes.left_out()  # a refused one stops before anything
    if _LOAD_FORMAT_TO_MODEL_LOADER.get(LOAD_FORMAT) is not GemmaQatModelLoader:
        register_model_loader(LOAD_FORMAT)(GemmaQatModelLoader)
    substitute.apply(preflight.substitutions(), "vllm-gemma-qat")
    fixes.install_all(without)
