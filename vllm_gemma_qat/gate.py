"""The load format's name and the one test of whether something runs under
it. Every runtime fix (`vllm_gemma_qat.fixes`) acts only for a model, runner
or command built with `--load-format gemma_qat`.

The lowest module of the plugin: it imports nothing, and anything may import
it (the package face re-exports `LOAD_FORMAT`; nothing imports the face).
"""
LOAD_FORMAT = "gemma_qat"


def is_gemma_qat(config) -> bool:
    """Whether `config` asks for the gemma_qat load format: a VllmConfig (or
    anything with a `load_config`), a LoadConfig, or EngineArgs (anything
    with a `load_format`)."""
    load_config = getattr(config, "load_config", config)
    return getattr(load_config, "load_format", None) == LOAD_FORMAT
