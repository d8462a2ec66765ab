"""The KV-pressure workload of the preemption tests (issue #21): a cache of
40 blocks holds two of eight requests (20-55-token prompts, 180 tokens
each) while they are short, and not as they grow, so vLLM preempts running
requests and recomputes them later. Async scheduling and prefix caching stay
at vLLM's defaults (on).

Sizes for the tiny E4B-like model under gemma_qat's sliding-window KV
(#3220): 4 groups of one page each (3 rows of sliding layers, 1 full layer)
draw on one pool of blocks. A request holds a block per 16 tokens of the
full layer and, per sliding row, the 2-4 blocks its 8-token window needs;
vLLM admits a request only when its prompt's full-layer blocks + 3 x 6
blocks (what it reserves per window at 32 tokens a step, async) are free.
Two short requests pass that (about 12 + 22 of 40 blocks) and outgrow the
cache at ~200 tokens each (2 x (13 + 3 x 3) > 40); a third waits."""
from __future__ import annotations

import concurrent.futures

from harness import complete

SMALL_CACHE = ("--num-gpu-blocks-override", "40")
# Distinct texts (no shared prefix), 20-55 tokens (the tokenizer is
# byte-level: one token per character).
PROMPTS = [(f"Agent {i} reads the log. " * 3)[:20 + 5 * i] for i in range(8)]
N = 180  # greedy tokens per answer


def reference(hf, prompt_ids, n=N) -> list[int]:
    """transformers' greedy continuation, not stopping at EOS (the requests
    set ignore_eos; `harness.hf_greedy` stops at EOS)."""
    import torch
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=n,
                          do_sample=False, eos_token_id=None)
    return out[0, len(prompt_ids):].tolist()


def answers(server, model, prompts, n=N) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, greedy tokens) of `prompts`, sent at once."""
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: complete(server, model, p, n=n),
                             prompts))


def references(hf, prompts_ids, n=N) -> list[list[int]]:
    """`reference` of each prompt, computed once per machine: a model-cache
    entry keyed by the model's tensors and config, the prompts, n, this
    file's source and the torch / transformers versions (8 x 180 tokens
    take ~27 s of one core)."""
    import json

    from vllm_gemma_qat.testing import model_cache
    prompts_ids = [[int(t) for t in ids] for ids in prompts_ids]

    def compute(directory):
        (directory / "greedy.json").write_text(json.dumps(
            [reference(hf, ids, n) for ids in prompts_ids]))

    entry = model_cache.reference("greedy-reference", hf,
                                  {"prompts": prompts_ids, "n": n}, __file__,
                                  compute)
    return json.loads((entry / "greedy.json").read_text())


def wrong_answers(hf, results, n=N) -> list[int]:
    """Indices of the results whose tokens differ from transformers'."""
    want = references(hf, [prompt_ids for prompt_ids, _ in results], n)
    return [i for i, ((_, tokens), expected) in enumerate(zip(results, want))
            if tokens != expected]
