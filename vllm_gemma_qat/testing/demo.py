"""The main job on an embedded default, on any machine: write a tiny random
Gemma 4 E2B-like QAT checkpoint (no shared-layer K/V: what tpu-inference
#3225 cannot load) with a Gemma-style tokenizer, start
`vllm serve <dir> --load-format gemma_qat` on JAX's CPU backend (CPU mode),
send a chat request to the OpenAI endpoint, print the answer, check its
tokens against transformers, stop the server.

    python -m vllm_gemma_qat.testing.demo [--dir DIR] [--max-tokens N] [--int4 FORM] [--image]

`--int4 w4a16` serves a compressed-tensors pack-quantized int4 export,
`--int4 q4_0` a bf16 q4_0-grid export made int4 exactly by
`--hf-overrides "$(vllm-gemma-qat int4-overrides)"`. `--image` adds Gemma
4's processor files and sends a chat request with a PNG image.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
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
    parser.add_argument("--image", action="store_true",
                        help="multimodal: ask about a PNG image")
    args = parser.parse_args(argv)

    import torch

    from vllm_gemma_qat import checkpoint, geometry, quantization
    from vllm_gemma_qat.cpu.server import STEP_TOKENS, CpuServer
    from vllm_gemma_qat.testing import tiny, tiny_mm
    root = Path(args.dir or tempfile.mkdtemp(prefix="vllm-gemma-qat-demo-"))
    model_dir = root / (f"gemma4-tiny-qat{'-' + args.int4 if args.int4 else ''}"
                        f"{'-mm' if args.image else ''}")
    extra = []
    if args.int4 == "q4_0":
        extra = ["--hf-overrides", json.dumps({"quantization_config":
                 quantization.w4a16_quantization_config()})]
    if args.image:
        hf = tiny_mm.save_servable_mm(model_dir, form=args.int4)
    elif args.int4:
        hf = tiny.save_servable_int4(model_dir, args.int4)
    else:
        hf = tiny.save_servable(model_dir)
    kind = f"int4 {args.int4}" if args.int4 else "bf16"
    report = geometry.check(checkpoint.open_checkpoint(model_dir))
    shared = sorted(report.geometry.kv_share_map)
    extras = "Gemma 4 processor files" if args.image else "tokenizer"
    print(f"1. wrote a tiny random Gemma 4 E2B-like QAT checkpoint ({kind}) "
          f"+ {extras}: {model_dir}\n   {report.lm_tensors} language-model "
          f"tensors; KV-shared layers {shared[0]}-{shared[-1]} have no "
          "k_proj / v_proj / k_norm (as Google's QAT exports)")
    print("2. stock tpu-inference (--load-format auto) on it ...", flush=True)
    refusal = _stock_refusal(model_dir, extra)
    print(f"   refused: {refusal}")
    print(f"3. vllm serve {model_dir} --load-format gemma_qat"
          f"{' --hf-overrides <w4a16>' if extra else ''}\n   (CPU mode: "
          "JAX's CPU backend, pure-JAX kernels; ~30-60 s of imports, model "
          f"build and compilation; log: {root / 'server.log'}) ...",
          flush=True)
    serve_args, step_tokens = extra, STEP_TOKENS
    content = "Hello! Who are you?"
    if args.image:
        # One image per request; its 70 soft-token budget in one step.
        serve_args = [*extra, "--limit-mm-per-prompt",
                      '{"image": 1, "video": 0}', "--disable-chunked-mm-input"]
        step_tokens = 128
        content = [{"type": "image_url",
                    "image_url": {"url": tiny_mm.png_data_uri(1)}},
                   {"type": "text", "text": "What is in the image?"}]
    with CpuServer(model_dir, *serve_args, log=root / "server.log",
                   step_tokens=step_tokens) as server:
        messages = [{"role": "user", "content": content}]
        reply = server.post("/v1/chat/completions", {
            "model": str(model_dir), "messages": messages, "temperature": 0,
            "max_tokens": args.max_tokens, "ignore_eos": True,
            "return_token_ids": True})
    log = (root / "server.log").read_text()
    for line in log.splitlines():
        if re.search(r"gemma_qat: (loaded|KV-shared|model weights)", line):
            print("   " + line.split("gemma_qat: ", 1)[1])
    prompt_ids = reply["prompt_token_ids"]
    tokens = reply["choices"][0]["token_ids"]
    if args.image:
        from transformers import AutoProcessor
        ref_prompt, ref = tiny_mm.hf_image_greedy(
            hf, AutoProcessor.from_pretrained(model_dir), [{
                "role": "user", "content": [
                    {"type": "image", "image": tiny_mm.png_image(1)},
                    {"type": "text", "text": "What is in the image?"}]}],
            args.max_tokens)
        ref = ref if ref_prompt == prompt_ids else None
        image = tiny_mm.token_ids()["image_token"]
        asked = (f"[32x32 PNG: {prompt_ids.count(image)} soft tokens] "
                 "'What is in the image?'")
    else:
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt_ids]),
                              max_new_tokens=args.max_tokens,
                              do_sample=False)[0, len(prompt_ids):].tolist()
        asked = repr(content)
    print(f"4. POST /v1/chat/completions {asked}")
    print(f"   answer:    {reply['choices'][0]['message']['content']!r} "
          "(random weights: random bytes)")
    print(f"   tokens:    {tokens}")
    print(f"   reference: {ref} (transformers greedy, same checkpoint"
          f"{', processor and image' if args.image else ''})")
    same = tokens == ref
    if same:
        print("proven: the checkpoint stock tpu-inference refuses (#3225) "
              "serves through vLLM's OpenAI endpoint with --load-format "
              "gemma_qat, its KV-shared layers own no K/V, and the answer "
              f"{'to an image ' if args.image else ''}equals transformers "
              "token for token")
    else:
        print("MISMATCH: served tokens (or the prompt) differ from "
              "transformers")
    return 0 if same else 1


def _stock_refusal(model_dir: Path, extra: list[str]) -> str:
    """The error stock `auto` gives for the checkpoint (built in a fresh
    process, as vLLM's engine would), first line only."""
    code = ("import sys, json\n"
            "from vllm_gemma_qat.testing.runner import load\n"
            "overrides = json.loads(sys.argv[2]) if len(sys.argv) > 2 else None\n"
            "try:\n"
            "    load(sys.argv[1], 'auto', hf_overrides=overrides)\n"
            "except Exception as e:\n"
            "    print('REFUSED', type(e).__name__, str(e).splitlines()[0])\n"
            "else:\n"
            "    print('LOADED')\n")
    overrides = [extra[1]] if extra else []
    out = subprocess.run([sys.executable, "-c", code, str(model_dir),
                          *overrides], capture_output=True, text=True,
                         env=dict(os.environ, VLLM_PLUGINS="register_layers"))
    lines = [line for line in out.stdout.splitlines()
             if line.startswith(("REFUSED", "LOADED"))]
    if not lines:
        return f"(the check itself failed: {out.stderr.strip()[-500:]})"
    text = lines[-1].removeprefix("REFUSED ")
    return text if len(text) < 240 else text[:240] + " ..."


if __name__ == "__main__":
    raise SystemExit(main())
