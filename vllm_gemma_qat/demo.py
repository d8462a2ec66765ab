"""The main job on an embedded default: build a tiny random Gemma 4 E2B-like
QAT checkpoint (no shared-layer K/V, exactly what breaks tpu-inference
#3225), load it with `--load-format gemma_qat` into tpu-inference's real JAX
model on the CPU backend, and generate tokens greedily; transformers decodes
the same checkpoint as the reference.

    python -m vllm_gemma_qat.demo [--checkpoint DIR] [--max-tokens N]
"""
from __future__ import annotations

import argparse
import os
import tempfile

CPU_ENV = {"JAX_PLATFORMS": "cpu", "TPU_NAME": "cpu-ci",
           "TPU_ACCELERATOR_TYPE": "v6e-1", "TPU_WORKER_ID": "0",
           "HF_HUB_OFFLINE": "1"}


def main(argv=None) -> int:
    for key, value in CPU_ENV.items():
        os.environ.setdefault(key, value)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", help="where to write the tiny "
                        "checkpoint (default: a temporary directory)")
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args(argv)

    import torch
    from vllm.plugins import load_general_plugins

    from vllm_gemma_qat import cpu_mode, tiny
    path = args.checkpoint or tempfile.mkdtemp(prefix="gemma4-tiny-qat-")
    hf = tiny.build_model("e2b", multimodal=True)
    tiny.save_checkpoint(hf, path, layout="qat")
    print(f"tiny Gemma 4 E2B-like QAT checkpoint: {path}")

    load_general_plugins()  # the plugin, through its vllm.general_plugins entry point
    cpu_mode.install_attention()
    model, config, mesh = cpu_mode.load(path, "gemma_qat")
    prompt = [2, 17, 123, 42, 301, 7, 88, 250, 19, 64, 5, 411, 99, 3, 12, 200,
              145, 33]
    tokens = cpu_mode.generate(cpu_mode.PagedRunner(model, config, mesh),
                               prompt, args.max_tokens)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=args.max_tokens,
                          do_sample=False)[0, len(prompt):].tolist()
    print(f"prompt ids:                   {prompt}")
    print(f"tpu-inference (gemma_qat):    {tokens}")
    print(f"transformers reference:       {ref}")
    same = tokens == ref
    print("greedy tokens match the reference" if same else "MISMATCH")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
