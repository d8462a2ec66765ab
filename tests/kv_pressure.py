"""The KV-pressure workload of the preemption tests (issue #21): a cache of
24 blocks (384 tokens) holds two or three of eight ~120-190-token prompts,
so vLLM preempts running requests and recomputes them later. Async
scheduling and prefix caching stay at vLLM's defaults (on)."""
from __future__ import annotations

import concurrent.futures

from harness import complete

SMALL_CACHE = ("--num-gpu-blocks-override", "24")
# Distinct texts (no shared prefix), 120-190 tokens (the tokenizer is
# byte-level: one token per character).
PROMPTS = [(f"Agent {i} reads the log. " * 9)[:120 + 10 * i] for i in range(8)]
N = 24  # greedy tokens per answer


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


def wrong_answers(hf, results, n=N) -> list[int]:
    """Indices of the results whose tokens differ from transformers'."""
    return [i for i, (prompt_ids, tokens) in enumerate(results)
            if tokens != reference(hf, prompt_ids, n)]
