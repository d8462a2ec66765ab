"""The main job on an embedded default, on any machine: write a tiny random
Gemma 4 E2B-like QAT checkpoint (no shared-layer K/V: what tpu-inference
#3225 cannot load) with a Gemma-style tokenizer, start
`vllm serve <dir> --load-format gemma_qat` on JAX's CPU backend (CPU mode),
send a chat request to the OpenAI endpoint, print the answer, check its
tokens against transformers, stop the server.

    python -m vllm_gemma_qat.testing.demo [--dir DIR] [--max-tokens N] [--int4 FORM]

`--int4 w4a16` serves a compressed-tensors pack-quantized int4 export,
`--int4 q4_0` a bf16 q4_0-grid export made int4 exactly by
`--hf-overrides "$(vllm-gemma-qat int4-overrides)"`.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from vllm_gemma_qat.cpu.env import set_defaults


def main(argv=None) -> int:
    set_defaults(os.environ)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", help="where to write the model and the "
                        "server log (default: a temporary directory)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--int4", choices=["w4a16", "q4_0"],
                        help="serve an int4 QAT export of the tiny model")
    args = parser.parse_args(argv)

    import torch

    from vllm_gemma_qat import quantization
    from vllm_gemma_qat.cpu.server import CpuServer
    from vllm_gemma_qat.testing import tiny
    root = Path(args.dir or tempfile.mkdtemp(prefix="vllm-gemma-qat-demo-"))
    model_dir = root / f"gemma4-tiny-qat{'-' + args.int4 if args.int4 else ''}"
    extra = []
    if args.int4:
        hf = tiny.save_servable_int4(model_dir, args.int4)
        if args.int4 == "q4_0":
            extra = ["--hf-overrides", json.dumps({"quantization_config":
                     quantization.w4a16_quantization_config()})]
    else:
        hf = tiny.save_servable(model_dir)
    kind = f"int4 {args.int4}" if args.int4 else "bf16"
    print(f"tiny Gemma 4 E2B-like QAT checkpoint ({kind}) + tokenizer: "
          f"{model_dir}")
    print(f"starting: vllm serve {model_dir} --load-format gemma_qat"
          f"{' --hf-overrides <w4a16>' if extra else ''} "
          f"(CPU mode; log: {root / 'server.log'})")
    with CpuServer(model_dir, *extra, log=root / "server.log") as server:
        messages = [{"role": "user", "content": "Hello! Who are you?"}]
        reply = server.post("/v1/chat/completions", {
            "model": str(model_dir), "messages": messages, "temperature": 0,
            "max_tokens": args.max_tokens, "ignore_eos": True,
            "return_token_ids": True})
    prompt_ids = reply["prompt_token_ids"]
    tokens = reply["choices"][0]["token_ids"]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt_ids]),
                          max_new_tokens=args.max_tokens,
                          do_sample=False)[0, len(prompt_ids):].tolist()
    print(f"request:   {messages[0]['content']!r}")
    print(f"answer:    {reply['choices'][0]['message']['content']!r} "
          "(random weights: random bytes)")
    print(f"tokens:    {tokens}")
    print(f"reference: {ref} (transformers, same checkpoint)")
    same = tokens == ref
    if args.int4:
        log = (root / "server.log").read_text()
        print(next(line.split("gemma_qat: ", 1)[1] for line in log.splitlines()
                   if "gemma_qat: model weights by dtype" in line))
    print("greedy tokens match the reference" if same else "MISMATCH")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
