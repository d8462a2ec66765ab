"""Test and demo support, never imported by the plugin or CPU mode: tiny
random Gemma 4 models and their checkpoints (`tiny`, via transformers),
full-size header-only checkpoints (`synthetic`), a runner for tpu-inference's
model outside vLLM's engine (`runner`), and the demo (`demo`)."""
